"""Grammars written for Lark (OpenAI's custom tools' `"syntax": "lark"`, vLLM's guidance backend, outlines), read
into the trees ebnf.py compiles, so a Lark grammar holds an output as an EBNF one does:

    start: expr ("=" expr)*
    expr: term (("+" | "-") term)*
    term: NUMBER | "(" expr ")"
    %import common.NUMBER
    %ignore " "

Read: rules (`name: ...`, lower case) and terminals (`NAME: ...`, upper case; a priority `.n` changes nothing
here), alternatives `|` (on following lines too), "strings" (with the `i` flag: either case), "a".."z" ranges,
/regular expressions/ (patterns.py's subset, without flags), names, ( groups ), [ optional ], `? * +`, `~ n` and
`~ n..m`; an alias `-> name` and the prefixes `?` and `!` change nothing a recogniser asks; `%import common.NAME`
(or `%import common (A, B)`) from Lark's common library, written out below; `%ignore` terminals or strings, which
may come between any two terminals of the rules and around the output, as Lark's lexer skips them. The output is
a `start`.

A recogniser of characters has no lexer: where Lark's lexer would cut a text into other tokens than the grammar
needs (a keyword inside a name; the longest match), this takes what any cut allows, so it may take a text Lark
would not parse, never one that no cut of the grammar allows. Templates, `%declare`, `%override` and `%extend` are
refused in one line.
"""

from __future__ import annotations

import re

from .errors import UserError
from .patterns import CharSet, _Parser

LARK_LINE = re.compile(r"^[ \t]*(?:[?!]?[A-Za-z_]\w*(?:\.-?\d+)?[ \t]*:(?!:)|%(?:import|ignore))", re.MULTILINE)
IGNORED = "%ignore"  # the rule of what %ignore skips (a name no grammar's rule can have)
MAX_SPACES = 32  # whitespace %ignore skips at one place, at most: grammar.py's cap on JSON's runs, for its reason
SPACE_CODES = frozenset(map(ord, " \t\n\r\f\v"))
START = "%start"  # the output: what is ignored, then `start`
TOKEN = re.compile(r"""
    (?P<space>[ \t\f\r]+|\\\n)
  | (?P<comment>//[^\n]*)
  | (?P<newline>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<directive>%[a-z]+)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>-?\d+)
  | (?P<op>\.\.|->|[:|()\[\]?*+~.,{}])
""", re.VERBOSE)

# Lark's common.lark, written out (the regular expressions in patterns.py's subset; an escaped string as any text
# of escapes and other characters between quotes, which is what Lark's lazy expression with a look-behind means)
COMMON = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+" | "-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e" | "E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+" | "-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+" | "-"] NUMBER
ESCAPED_STRING: /"(\\.|[^"\\\n])*"/
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_" | LETTER) ("_" | LETTER | DIGIT)*
WS_INLINE: (" " | /\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
C_COMMENT: /\/\*([^*]|\*+[^*\/])*\*+\//
SQL_COMMENT: /--[^\n]*/
"""


def lark_trees(text: str) -> tuple[dict[str, tuple], str]:
    """(definitions as ebnf.py's trees, the name of the output's rule) of a Lark grammar."""
    reader = _LarkReader(text)
    reader.read()
    return reader.finished()


def looks_like_lark(text: str) -> bool:
    """Whether a grammar's text is Lark's (`name: ...`, %import, %ignore) rather than EBNF's (`name ::= ...`)."""
    return "::=" not in text and bool(LARK_LINE.search(text))


def is_terminal(name: str) -> bool:
    """Lark's convention: a terminal's name is upper case (past any leading underscores)."""
    return name.lstrip("_")[:1].isupper()


class _LarkReader:
    """A reader of a Lark grammar's tokens (TOKEN) into ebnf.py's trees, definition by definition: a statement ends
    at a line's end unless the next line goes on with `|`; a rule's terminals are marked ("terminal", tree) until
    the whole grammar says whether anything is ignored (finished)."""

    def __init__(self, text: str):
        self.text = text
        self.tokens = self._tokens(text)
        self.at = 0
        self.definitions: dict[str, tuple] = {}
        self.ignored: list[tuple] = []
        self.imported: set[str] = set()

    def fail(self, what: str, position: int | None = None):
        if position is None:
            position = self.tokens[min(self.at, len(self.tokens) - 1)][2] if self.tokens else 0
        line = self.text.count("\n", 0, position) + 1
        raise UserError(f"Lark grammar, line {line}: {what}")

    def _tokens(self, text: str) -> list[tuple[str, str, int]]:
        tokens, at = [], 0
        while at < len(text):
            found = TOKEN.match(text, at)
            if found is None:
                self.tokens = [("?", "", at)]
                self.fail(f"unexpected {text[at]!r}", at)
            kind = found.lastgroup
            if kind not in ("space", "comment"):
                tokens.append((kind, found.group(), at))
            at = found.end()
        return tokens

    # ---- statements ------------------------------------------------------------------------------------------
    def peek(self, skip_lines: bool = False) -> tuple[str, str, int] | None:
        at = self.at
        while skip_lines and at < len(self.tokens) and self.tokens[at][0] == "newline":
            at += 1
        return self.tokens[at] if at < len(self.tokens) else None

    def take(self, kind: str | None = None, value: str | None = None) -> tuple[str, str, int]:
        token = self.peek()
        if token is None or (kind and token[0] != kind) or (value and token[1] != value):
            self.fail(f"expected {value or kind}, found {token[1]!r}" if token else f"expected {value or kind}")
        self.at += 1
        return token

    def read(self) -> None:
        while (token := self.peek(skip_lines=True)) is not None:
            while self.peek()[0] == "newline":
                self.at += 1
            if token[0] == "directive":
                self.directive()
            elif token[0] == "name":
                self.definition()
            else:
                self.fail(f"expected a rule (`name: ...`), a terminal (`NAME: ...`) or a %directive, found "
                          f"{token[1]!r}")
            token = self.peek()
            if token is not None and token[0] != "newline":
                self.fail(f"unexpected {token[1]!r} after the statement")

    def definition(self) -> None:
        kind, name, position = self.take("name")
        name = name.lstrip("?!")
        if self.peek() and self.peek()[1] == "{":
            self.fail("templates (`name{...}`) are not supported")
        if self.peek() and self.peek()[1] == ".":  # a priority
            self.at += 1
            self.take("number")
        self.take("op", ":")
        if name in self.definitions:
            self.fail(f"{name!r} is defined twice")
        self.definitions[name] = self.expansions(in_rule=not is_terminal(name))

    def directive(self) -> None:
        _, word, _ = self.take("directive")
        if word == "%ignore":
            self.ignored.append(self.expansions(in_rule=False))
        elif word == "%import":
            self.importing()
        else:
            self.fail(f"{word} is not supported (%import common and %ignore are)")

    def importing(self) -> None:
        _, path, _ = self.take("name")
        names = []
        if self.peek() and self.peek()[1] == ".":
            self.at += 1
            names.append(self.take("name")[1])
            if self.peek() and self.peek()[1] == "->":
                self.fail("%import with an alias is not supported")
        elif self.peek() and self.peek()[1] == "(":
            self.at += 1
            while True:
                names.append(self.take("name")[1])
                if self.take("op")[1] == ")":
                    break
        if path != "common" or not names:
            self.fail("only Lark's common library is known: %import common.NAME or %import common (A, B)")
        self.imported.update(names)

    # ---- expansions ------------------------------------------------------------------------------------------
    def expansions(self, in_rule: bool) -> tuple:
        branches = [self.expansion(in_rule)]
        while (token := self.peek(skip_lines=True)) is not None and token[1] == "|":
            while self.peek()[0] == "newline":
                self.at += 1
            self.at += 1
            branches.append(self.expansion(in_rule))
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def expansion(self, in_rule: bool) -> tuple:
        items = []
        while (token := self.peek()) is not None and token[0] != "newline" and token[1] not in ("|", ")", "]", "->"):
            items.append(self.repeated(self.atom(in_rule)))
        if self.peek() and self.peek()[1] == "->":  # an alias names the tree Lark builds: nothing here
            self.at += 1
            self.take("name")
        return ("seq", items)

    def repeated(self, tree: tuple) -> tuple:
        token = self.peek()
        if token is None or token[1] not in ("?", "*", "+", "~"):
            return tree
        self.at += 1
        if token[1] != "~":
            return ("repeat", tree, int(token[1] == "+"), 1 if token[1] == "?" else None)
        low = high = int(self.take("number")[1])
        if self.peek() and self.peek()[1] == "..":
            self.at += 1
            high = int(self.take("number")[1])
        if low < 0 or high < low:
            self.fail(f"the repetition ~ {low}..{high}")
        return ("repeat", tree, low, high)

    def atom(self, in_rule: bool) -> tuple:
        kind, value, position = self.take()
        if value in ("(", "["):
            inner = self.expansions(in_rule)
            while self.peek() and self.peek()[0] == "newline":
                self.at += 1
            self.take("op", ")" if value == "(" else "]")
            return inner if value == "(" else ("repeat", inner, 0, 1)
        if kind == "string":
            tree = self.string(value, position)
        elif kind == "regex":
            tree = self.regex(value, position)
        elif kind == "name":
            name = value.lstrip("?!")
            if self.peek() and self.peek()[1] == "{":
                self.fail("templates (`name{...}`) are not supported")
            tree = ("ref", name, position)
            if not is_terminal(name):
                return tree
        else:
            self.fail(f"unexpected {value!r}")
        return ("terminal", tree) if in_rule else tree  # what %ignore may follow (finished)

    def string(self, value: str, position: int) -> tuple:
        folded = value.endswith("i")
        codes = _literal(value[1: -2 if folded else -1], self, position)
        if self.peek() and self.peek()[1] == "..":  # a range of single characters, "a".."z"
            self.at += 1
            _, other, _ = self.take("string")
            high = _literal(other[1:-1], self, position)
            if len(codes) != 1 or len(high) != 1 or high[0] < codes[0]:
                self.fail('a range is "a".."z": one character each, the lower first')
            return ("chars", CharSet(((codes[0], high[0]),)))
        chars = []
        for code in codes:
            cases = {code, ord(chr(code).lower()), ord(chr(code).upper())} if folded else {code}
            chars.append(("chars", CharSet(tuple((c, c) for c in sorted(c for c in cases if c < 0x110000)))))
        return ("seq", chars)

    def regex(self, value: str, position: int) -> tuple:
        source, flags = value[1:value.rindex("/")], value[value.rindex("/") + 1:]
        if flags:
            self.fail(f"regular expression flags ({flags}) are not supported")
        source = source.replace("\\/", "/")
        tree, anchored_start, anchored_end = _Parser(source).parse()
        if anchored_start or anchored_end:
            self.fail("a terminal's regular expression cannot be anchored (^ or $)")
        return tree

    # ---- the whole grammar ---------------------------------------------------------------------------------------
    def finished(self) -> tuple[dict[str, tuple], str]:
        definitions = dict(self.definitions)
        if self.imported:
            common = _LarkReader(COMMON)
            common.read()
            for name in sorted(self.imported):
                if name not in common.definitions:
                    self.fail(f"common.{name} is not in Lark's common library as written here")
            for name, tree in common.definitions.items():  # what they use comes with them
                definitions.setdefault(name, tree)
        if "start" not in definitions:
            raise UserError("the Lark grammar has no rule `start` (where the output starts)")
        ignoring = bool(self.ignored)
        trees = {name: _with_ignored(tree, ignoring) for name, tree in definitions.items()}
        if not ignoring:
            return trees, "start"
        trees[IGNORED] = ignored_tree(self.ignored, definitions)
        trees[START] = ("seq", [("ref", IGNORED, 0), ("ref", "start", 0)])
        return trees, START


def ignored_tree(ignored: list[tuple], definitions: dict) -> tuple:
    """What %ignore skips at one place: any run of what it names, but whitespace at most MAX_SPACES characters
    at a time. A small model under a mask pads with newlines until it runs out of tokens where nothing bounds them
    (as under JSON's, grammar.py); a terminal of whitespace characters (WS, WS_INLINE, " ") is read as up to
    MAX_SPACES of them, and the others (a comment) come between such runs, never two runs side by side. What is
    taken stays in the grammar's language."""
    spaces = [space_class(item, definitions) for item in ignored]
    others = [item for item, space in zip(ignored, spaces) if space is None]
    found = [space for space in spaces if space is not None]
    if not found:
        return ("repeat", ("alt", others) if len(others) > 1 else others[0], 0, None)
    run = ("repeat", ("chars", CharSet(tuple(pair for space in found for pair in space.ranges))), 0, MAX_SPACES)
    if not others:
        return run
    return ("seq", [run, ("repeat", ("seq", [("alt", others) if len(others) > 1 else others[0], run]), 0, None)])


def space_class(tree: tuple, definitions: dict) -> CharSet | None:
    """The whitespace characters C where `tree` matches one of them, or a run of them (C, C+, C*); None for any
    other tree."""
    tree = _unwrapped(tree, definitions)
    if tree is not None and tree[0] == "repeat" and tree[2] <= 1 and tree[3] is None:
        return _one_space(tree[1], definitions)
    return _one_space(tree, definitions)


def _one_space(tree: tuple | None, definitions: dict) -> CharSet | None:
    """The whitespace characters C where `tree` matches exactly one character, one of C."""
    tree = _unwrapped(tree, definitions)
    if tree is None:
        return None
    if tree[0] == "chars":
        chars = tree[1]
        spaces = not chars.negated and chars.ranges and all(
            low in SPACE_CODES and high - low < 32 and all(c in SPACE_CODES for c in range(low, high + 1))
            for low, high in chars.ranges)
        return chars if spaces else None
    if tree[0] == "alt":
        parts = [_one_space(branch, definitions) for branch in tree[1]]
        if parts and all(part is not None for part in parts):
            return CharSet(tuple(pair for part in parts for pair in part.ranges))
    return None


def _unwrapped(tree: tuple | None, definitions: dict, depth: int = 0) -> tuple | None:
    """`tree` without sequences of one item and with a terminal's name read as its definition."""
    while tree is not None and depth < 64:
        if tree[0] == "seq" and len(tree[1]) == 1:
            tree = tree[1][0]
        elif tree[0] == "ref":
            tree = definitions.get(tree[1])
        else:
            return tree
        depth += 1
    return None


def _with_ignored(tree: tuple, ignoring: bool) -> tuple:
    """A tree with each terminal of a rule followed by what %ignore skips (where anything is ignored)."""
    kind = tree[0]
    if kind == "terminal":
        return ("seq", [tree[1], ("ref", IGNORED, 0)]) if ignoring else tree[1]
    if kind in ("seq", "alt"):
        return (kind, [_with_ignored(t, ignoring) for t in tree[1]])
    if kind == "repeat":
        return ("repeat", _with_ignored(tree[1], ignoring), tree[2], tree[3])
    return tree


def _literal(body: str, reader: _LarkReader, position: int) -> list[int]:
    """A Lark string's characters (Python's escapes)."""
    try:
        text = body.encode("latin-1", "backslashreplace").decode("unicode_escape") if "\\" in body else body
    except UnicodeDecodeError:
        reader.fail(f"a bad escape in the string \"{body}\"", position)
    return [ord(c) for c in text]
