"""A whole output held to a context-free grammar written in EBNF (vLLM's structured outputs `grammar`, SGLang's
`ebnf`), as xgrammar and llama.cpp's GBNF write it:

    root  ::= expr ("=" expr)*      # a comment
    expr  ::= expr [-+*/] term | term
    term  ::= [0-9]+ | "(" expr ")"

A rule `name ::= expression` starts on its own line and may span several; names are letters, digits, `_`, `-` and
`.`, not starting with a digit; `root` is the whole output. An expression is built of "literals" (the escapes `\\n \\r
\\t \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH` and the like), character classes (`[a-z_]`, `[^"\\\\]`, `[^]` any character),
`.` (any character), rule names, `( groups )`, alternatives `|` and the repetitions `? * + {n} {n,} {n,m}`. xgrammar's
macros (TagDispatch, Token), lookaheads and rule options are refused in one line. A grammar in Lark's syntax
(`start: ...`, no `::=`) is read by lark_grammar.py into the same trees.

The recogniser is a pushdown automaton with every choice kept: a state is the set of the parser's possible stacks of
what is still to come (rule names and character classes as flat tuples, the next at the end, so hashing one never
recurses however deep the output nests), each expanded until a class is on top, or empty where the output may end; a
reading nested past MAX_DEPTH symbols, or past MAX_STACKS readings, is dropped. A character pops the classes it
falls in and expands again. The interface is patterns.Pattern's (`start`, `step`, `can_take`, `accepts`), so
regex_grammar.PatternGrammar reads the output's UTF-8 bytes through it and structured.py makes its masks as for any
grammar. What makes that terminate is checked when the grammar compiles: every rule the root reaches can finish (so
every stack can end, and a state is never a dead end), and no rule reaches itself on its left with something after
it (left recursion, which would stack without end). Direct left recursion (`expr ::= expr "+" term | term`) is
rewritten to the right (`expr ::= term expr'`, `expr' ::= "+" term expr' | ""`), which keeps the language; left
recursion through other rules is refused with the rules named.
"""

from __future__ import annotations

import functools
import re

from .errors import UserError
from .lark_grammar import lark_trees, looks_like_lark
from .patterns import ANY, INFINITE, CharSet
from .regex_grammar import PATTERN, PatternGrammar, shared_grammar

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
RULE_START = re.compile(r"([A-Za-z_][A-Za-z0-9_.\-]*)[ \t]*(\[[^\]\n]*\])?[ \t]*::=")
MACROS = ("TagDispatch", "TokenTagDispatch", "Token", "ExcludeToken")  # xgrammar's, refused by name
SIMPLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "b": 0x08, "f": 0x0C, "a": 0x07, "v": 0x0B, "0": 0x00,
                  "e": 0x1B}
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
MAX_SYMBOLS = 200_000  # of the compiled rules: a repetition {n,m} copies what it repeats
# readings one expansion may hold: a grammar ambiguous enough to pass it keeps the first ones met (in an order that
# is the same every run), so its output stays one the grammar allows, and no request fails the batch it runs in
MAX_STACKS = 20_000
MAX_DEPTH = 10_000  # symbols one stack may hold: an output nested deeper than that is not taken
MAX_STEPS = 200_000  # steps kept per grammar before they are found again


class _Reader:
    """A recursive-descent reader of the grammar's text into rules of trees: ("chars", CharSet), ("ref", name, at),
    ("seq", [trees]), ("alt", [trees]), ("repeat", tree, low, high or None)."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def fail(self, what: str):
        line = self.text.count("\n", 0, self.at) + 1
        column = self.at - (self.text.rfind("\n", 0, self.at) + 1) + 1
        raise UserError(f"grammar, line {line} column {column}: {what}")

    def rules(self) -> dict[str, tuple]:
        rules: dict[str, tuple] = {}
        self.skip()
        if self.at < len(self.text) and not RULE_START.match(self.text, self.at):
            if re.match(r"[A-Za-z_?!][\w.]*[ \t]*:(?!:)", self.text[self.at:]):
                self.fail("this mixes Lark's `name: ...` with EBNF's `name ::= ...`: write one or the other")
            self.fail("expected a rule, `name ::= expression`")
        while self.at < len(self.text):
            start = RULE_START.match(self.text, self.at)
            if start is None:
                self.fail(f"unexpected {self.text[self.at]!r}")
            name, options = start.group(1), start.group(2)
            if options:
                self.fail(f"rule options such as {options} are not supported")
            if name in rules:
                self.fail(f"rule {name!r} is defined twice")
            self.at = start.end()
            rules[name] = self.alternation()
            self.skip()
        return rules

    def skip(self) -> None:
        """Past whitespace, line breaks and comments: a rule's body may span lines."""
        while self.at < len(self.text):
            char = self.text[self.at]
            if char == "#":
                end = self.text.find("\n", self.at)
                self.at = len(self.text) if end < 0 else end
            elif char.isspace():
                self.at += 1
            else:
                return

    def peek(self) -> str | None:
        self.skip()
        if self.at >= len(self.text) or RULE_START.match(self.text, self.at):
            return None  # the end of this rule: the next one's name, or the end of the text
        return self.text[self.at]

    def alternation(self) -> tuple:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.at += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self) -> tuple:
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeated(self.element()))
        return items[0] if len(items) == 1 else ("seq", items)

    def repeated(self, tree: tuple) -> tuple:
        char = self.peek()
        if char in ("?", "*", "+"):
            self.at += 1
            tree = ("repeat", tree, int(char == "+"), 1 if char == "?" else None)
        elif char == "{":
            tree = ("repeat", tree, *self.braces())
        else:
            return tree
        if self.peek() in ("?", "*", "+", "{"):
            self.fail("two repetitions on one element; group it first: (x+)*")
        return tree

    def braces(self) -> tuple[int, int | None]:
        found = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}").match(self.text, self.at)
        if found is None:
            self.fail("a repetition is {n}, {n,} or {n,m}")
        self.at = found.end()
        low = int(found.group(1))
        high = low if found.group(2) is None else (int(found.group(3)) if found.group(3) else None)
        if high is not None and high < low:
            self.fail(f"the repetition {found.group(0)} has its bounds the wrong way round")
        return low, high

    def element(self) -> tuple:
        char = self.peek()
        if char == '"':
            self.at += 1
            return ("seq", [("chars", CharSet(((code, code),))) for code in self.literal()])
        if char == "[":
            self.at += 1
            return ("chars", self.char_class())
        if char == ".":
            self.at += 1
            return ("chars", ANY)
        if char == "(":
            self.at += 1
            if self.text.startswith(("=", "!"), self.at):
                self.fail("lookahead assertions are not supported")
            tree = self.alternation()
            if self.peek() != ")":
                self.fail("an unclosed group: expected ')'")
            self.at += 1
            return tree
        name = NAME.match(self.text, self.at)
        if name is None:
            self.fail(f"unexpected {char!r}" + (": strings are written in double quotes" if char == "'" else ""))
        if self.text.startswith("(", name.end()):
            which = name.group(0) if name.group(0) in MACROS else "macros such as " + name.group(0) + "(...)"
            self.fail(f"{which} (xgrammar's) is not supported")
        self.at = name.end()
        return ("ref", name.group(0), name.start())

    def literal(self) -> list[int]:
        codes = []
        while True:
            if self.at >= len(self.text) or self.text[self.at] == "\n":
                self.fail("an unclosed string")
            char = self.text[self.at]
            self.at += 1
            if char == '"':
                return codes
            codes.append(self.escape() if char == "\\" else ord(char))

    def escape(self) -> int:
        if self.at >= len(self.text):
            self.fail("a trailing backslash")
        char = self.text[self.at]
        self.at += 1
        if char in SIMPLE_ESCAPES:
            return SIMPLE_ESCAPES[char]
        digits = {"x": None, "u": 4, "U": 8}.get(char, 0)
        if digits == 0:
            if char.isalnum():
                self.fail(f"the escape \\{char} (write classes out: [0-9], [ \\t\\n])")
            return ord(char)
        end = self.at
        while end < len(self.text) and self.text[end] in HEX_DIGITS and (digits is None or end - self.at < digits):
            end += 1
        if end == self.at or (digits is not None and end - self.at != digits):
            self.fail(f"the escape \\{char} needs {digits or 'some'} hex digits")
        code = int(self.text[self.at:end], 16)
        self.at = end
        if code > 0x10FFFF:
            self.fail(f"\\{char}{code:X} is past the last Unicode character")
        return code

    def char_class(self) -> CharSet:
        negated = self.text.startswith("^", self.at)
        self.at += negated
        ranges = []
        while True:
            if self.at >= len(self.text) or self.text[self.at] == "\n":
                self.fail("an unclosed character class")
            if self.text[self.at] == "]":
                self.at += 1
                return CharSet(tuple(ranges), negated)
            low = self.class_member()
            if self.text.startswith("-", self.at) and not self.text.startswith("-]", self.at):
                self.at += 1
                high = self.class_member()
                if high < low:
                    self.fail("a range in a class runs backwards")
                ranges.append((low, high))
            else:
                ranges.append((low, low))

    def class_member(self) -> int:
        if self.at >= len(self.text):
            self.fail("an unclosed character class")
        char = self.text[self.at]
        self.at += 1
        return self.escape() if char == "\\" else ord(char)


def grammar_trees(text: str) -> tuple[dict[str, tuple], str]:
    """(the grammar's rules as trees, the name of the output's rule): EBNF's (`root ::= ...`), or Lark's
    (`start: ...`, lark_grammar.py)."""
    if looks_like_lark(text):
        return lark_trees(text)
    trees = _Reader(text).rules()
    if "root" not in trees:
        raise UserError("the grammar has no rule `root` (where the output starts)")
    return trees, "root"


class RuleSet:
    """Rules lowered to alternatives of symbols: a symbol >= 0 is a rule (`self.names[symbol]`), one < 0 a character
    class (`self.classes[-1 - symbol]`)."""

    def __init__(self, text: str):
        trees, self.root = grammar_trees(text)
        self.text, self.size = text, 0
        self.names: list[str] = []
        self.numbers: dict[str, int] = {}
        self.alternatives: list[list[tuple]] = []
        self.classes: list[CharSet] = []
        self.class_numbers: dict[CharSet, int] = {}
        for name in trees:
            self.numbers[name] = self.rule(name)
        for name, tree in trees.items():
            self.alternatives[self.numbers[name]] = self.lower(tree, trees, name)

    def rule(self, name: str, alternatives: list[tuple] | None = None) -> int:
        """A new rule; the compiler's own (for a group, a repetition) are named after the rule they serve and a
        number, with a character no rule's name can have, so they clash with none."""
        self.names.append(name if alternatives is None else f"{name}#{len(self.names)}")
        self.alternatives.append(alternatives or [])
        return len(self.names) - 1

    def count(self, alternatives: list[tuple]) -> list[tuple]:
        self.size += sum(len(a) + 1 for a in alternatives)
        if self.size > MAX_SYMBOLS:
            raise UserError(f"the grammar is too large to enforce (over {MAX_SYMBOLS} symbols once its repetitions "
                            "are written out); repeat less")
        return alternatives

    def lower(self, tree: tuple, trees: dict, of: str) -> list[tuple]:
        """`tree` (in the rule `of`) as alternatives, each a tuple of symbols."""
        if tree[0] == "alt":
            return self.count([alt for branch in tree[1] for alt in self.lower(branch, trees, of)])
        if tree[0] == "seq":
            return self.count([sum((self.one(item, trees, of) for item in tree[1]), ())])
        return self.count([self.one(tree, trees, of)])

    def one(self, tree: tuple, trees: dict, of: str) -> tuple:
        """`tree` as one sequence of symbols: a group of several alternatives becomes a rule of its own."""
        kind = tree[0]
        if kind == "chars":
            number = self.class_numbers.setdefault(tree[1], len(self.class_numbers))
            if number == len(self.classes):
                self.classes.append(tree[1])
            return (-1 - number,)
        if kind == "ref":
            if tree[1] not in trees:
                line = self.text.count("\n", 0, tree[2]) + 1
                raise UserError(f"grammar, line {line}: rule {tree[1]!r} is not defined (in the rule {of!r})")
            return (self.numbers[tree[1]],)
        if kind == "repeat":
            return self.repetition(self.one(tree[1], trees, of), tree[2], tree[3], of)
        alternatives = self.lower(tree, trees, of)
        return alternatives[0] if len(alternatives) == 1 else (self.rule(of, alternatives),)

    def repetition(self, item: tuple, low: int, high: int | None, of: str) -> tuple:
        """item{low,high}: `low` copies, then a rule taking any number more (high None), or a chain of optional ones
        (x{0,3} = (x (x (x)?)?)?)."""
        if len(item) * max(low, high or 0) > MAX_SYMBOLS:
            self.count([()] * (MAX_SYMBOLS + 1))
        if high is None:
            star = self.rule(of, [()])
            self.alternatives[star] = self.count([item + (star,), ()])
            return item * low + (star,)
        rest: tuple = ()
        for _ in range(high - low):
            rest = (self.rule(of, self.count([item + rest, ()])),)
        return item * low + rest

    # ---- what the recogniser relies on -----------------------------------------------------------------------
    def nullable(self) -> list[bool]:
        """Whether each rule may match the empty string."""
        return self._fixpoint(lambda symbol: False)

    def productive(self) -> list[bool]:
        """Whether each rule can finish: some alternative whose symbols all can (a class unless it is empty)."""
        return self._fixpoint(lambda symbol: self.classes[-1 - symbol].meets(0, 0x10FFFF))

    def _fixpoint(self, class_holds) -> list[bool]:
        """The rules with an alternative whose symbols all hold: a class where `class_holds` says so, a rule once it
        is found to. A worklist: each alternative counts its symbols not known to hold, and a rule found wakes the
        alternatives that use it (linear in the grammar's size, where sweeping until nothing changes is not)."""
        done = [False] * len(self.names)
        missing: dict[tuple[int, int], int] = {}  # (rule, alternative) -> its rules not yet found
        users: dict[int, list[tuple[int, int]]] = {}  # rule -> the alternatives using it, once per use
        found = []
        for rule, alternatives in enumerate(self.alternatives):
            for k, alternative in enumerate(alternatives):
                if not all(class_holds(symbol) for symbol in alternative if symbol < 0):
                    continue  # a class that never holds: so never does the alternative
                for symbol in alternative:
                    if symbol >= 0:
                        users.setdefault(symbol, []).append((rule, k))
                missing[(rule, k)] = sum(symbol >= 0 for symbol in alternative)
                if missing[(rule, k)] == 0 and not done[rule]:
                    done[rule] = True
                    found.append(rule)
        while found:
            for rule, k in users.get(found.pop(), ()):
                missing[(rule, k)] -= 1
                if missing[(rule, k)] == 0 and not done[rule]:
                    done[rule] = True
                    found.append(rule)
        return done

    def reachable(self, start: int) -> list[int]:
        seen, todo = {start}, [start]
        while todo:
            for alt in self.alternatives[todo.pop()]:
                for s in alt:
                    if s >= 0 and s not in seen:
                        seen.add(s)
                        todo.append(s)
        return sorted(seen)

    def unleft(self) -> None:
        """Direct left recursion rewritten to the right: A ::= A x | A y | b | c becomes A ::= b A' | c A',
        A' ::= x A' | y A' | "" (the same strings; A ::= A alone adds none)."""
        for number in range(len(self.names)):
            alts = self.alternatives[number]
            tails = [alt[1:] for alt in alts if alt[:1] == (number,) and len(alt) > 1]
            if tails:
                tail = self.rule(self.names[number].split("#")[0], [()])
                self.alternatives[tail] = [t + (tail,) for t in tails] + [()]
                self.alternatives[number] = [alt + (tail,) for alt in alts if alt[:1] != (number,)]

    def left_recursion(self, rules: list[int]) -> list[str] | None:
        """A cycle of rules, each first (past rules that may be empty) in an alternative of the one before, with
        something after it at least once (so the stack would grow without end): the rules' names, or None."""
        empty = self.nullable()
        edges: dict[int, list[tuple[int, bool]]] = {r: [] for r in rules}
        for r in rules:
            for alt in self.alternatives[r]:
                for i, s in enumerate(alt):
                    if s < 0:
                        break
                    edges[r].append((s, i < len(alt) - 1))
                    if not empty[s]:
                        break
        component = components(rules, {r: [s for s, _ in edges[r]] for r in rules})
        for r in rules:  # a growing edge lies on a cycle exactly where both its ends share a component
            for s, grows in edges[r]:
                if grows and component[s] == component[r]:
                    path = [r] + _path(s, r, edges, component)
                    names = [self.names[n].split("#")[0] for n in path]  # a helper rule by the rule it serves
                    return [n for i, n in enumerate(names[:-1]) if i == 0 or n != names[i - 1]] + names[-1:]
        return None


def components(nodes: list[int], edges: dict[int, list[int]]) -> dict[int, int]:
    """Each node's strongly connected component (Tarjan's algorithm, without recursion: grammars nest deep)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    component: dict[int, int] = {}
    stack: list[int] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, next_edge = work.pop()
            if next_edge == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
            for k in range(next_edge, len(edges[node])):
                following = edges[node][k]
                if following not in index:
                    work += [(node, k + 1), (following, 0)]
                    break
                if following not in component:  # on the stack
                    low[node] = min(low[node], index[following])
            else:
                if low[node] == index[node]:
                    while True:
                        member = stack.pop()
                        component[member] = node
                        if member == node:
                            break
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return component


def _path(start: int, end: int, edges: dict, component: dict) -> list[int]:
    """A shortest path from `start` to `end` inside their component (both ends included)."""
    before, todo = {start: None}, [start]
    while end not in before:
        following = []
        for node in todo:
            for s, _ in edges[node]:
                if s not in before and component[s] == component[start]:
                    before[s] = node
                    following.append(s)
        todo = following
    path, at = [], end
    while at is not None:
        path.append(at)
        at = before[at]
    return path[::-1]


class RuleAutomaton:
    """The recogniser of a grammar's `root` (the module's docstring), with patterns.Pattern's interface."""

    def __init__(self, text: str):
        rules = RuleSet(text)
        rules.unleft()
        root = rules.numbers[rules.root]
        used = rules.reachable(root)
        finishes = rules.productive()
        stuck = [rules.names[r] for r in used if not finishes[r]]
        if stuck:
            names = sorted({name.split("#")[0] for name in stuck})
            raise UserError(f"the grammar's rule(s) {', '.join(names)} can never finish (each alternative needs the "
                            "rule again, or an empty class): no output would match")
        cycle = rules.left_recursion(used)
        if cycle is not None:
            raise UserError(f"left recursion through {' -> '.join(cycle)} is not supported (only a rule's own, "
                            "`a ::= a x | y`); write it to the right: `a ::= y x*`")
        self.source = text
        self.classes = rules.classes
        # each alternative as it goes onto a stack: its symbols last first, the next to match at the end
        self.pushed = [[tuple(reversed(alternative)) for alternative in alternatives]
                       for alternatives in rules.alternatives]
        self._steps: dict[tuple[frozenset, int], frozenset] = {}
        self.start = self._expand([(root,)])

    def accepts(self, states: frozenset) -> bool:
        return () in states

    def can_take(self, states: frozenset, low: int, high: int, budget: float = INFINITE) -> bool:
        """Whether some character in [low, high] goes on from `states` (every stack can finish, so any that takes
        one still leads to a match)."""
        return any(stack and self.classes[-1 - stack[-1]].meets(low, high) for stack in states)

    def step(self, states: frozenset, code: int) -> frozenset:
        key = (states, code)
        following = self._steps.get(key)
        if following is None:
            moved = [stack[:-1] for stack in states if stack and code in self.classes[-1 - stack[-1]]]
            following = self._expand(moved)
            if len(self._steps) > MAX_STEPS:
                self._steps.clear()
            self._steps[key] = following
        return following

    def _expand(self, stacks) -> frozenset:
        """Every stack with a class on top (or empty) that `stacks` expand to; readings nested past MAX_DEPTH
        symbols are dropped."""
        ready, seen, todo = set(), set(stacks), list(stacks)
        while todo:
            stack = todo.pop()
            if not stack or stack[-1] < 0:
                ready.add(stack)
                continue
            rest = stack[:-1]
            for alternative in self.pushed[stack[-1]]:
                pushed = rest + alternative
                if pushed not in seen and len(pushed) <= MAX_DEPTH and len(seen) < MAX_STACKS:
                    seen.add(pushed)
                    todo.append(pushed)
        return frozenset(ready)


@functools.lru_cache(maxsize=64)
def compile_rules(text: str) -> RuleAutomaton:
    """The automaton of a grammar's text (refused in one line where it cannot be enforced), one each while in use."""
    if not isinstance(text, str) or not text.strip():
        raise UserError("a grammar must be EBNF text with a rule `root ::= ...`")
    try:
        return RuleAutomaton(text)
    except RecursionError:
        raise UserError("the grammar nests its groups too deeply to compile") from None


class RulesGrammar(PatternGrammar):
    """A whole output held to a grammar, read from its UTF-8 bytes as regex_grammar reads a pattern's (thinking
    first too), with a RuleAutomaton in the pattern's place. Its masks are walked, never tabled: a grammar that nests
    has states without end, where a table's exploration would only stop at its cap."""

    kind = "grammar"
    table_states = 0
    automaton = staticmethod(compile_rules)

    # A state carries its set of stacks itself, not a number for it: a grammar that nests has states without end,
    # and numbering them would keep every one met for as long as the grammar is in use (masks and moves are kept
    # in caches of bounded size instead).
    def state_set(self, states: frozenset) -> frozenset:
        return states

    def _state(self, states: frozenset) -> tuple:
        return (PATTERN, states)


def rules_grammar(text: str, thinking: str | None = None) -> RulesGrammar:
    return shared_grammar(RulesGrammar, text, thinking)


def grammar_format(text) -> tuple[str, dict]:
    """(response_format, json_schema) of GenerationConfig for a grammar's text, checked here: a grammar that cannot
    be enforced is refused before anything is generated."""
    if not isinstance(text, str):
        raise UserError(f"a grammar must be EBNF text, got {type(text).__name__}")
    compile_rules(text)
    return "grammar", {"grammar": text}
