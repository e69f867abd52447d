"""JSON as a pushdown automaton over bytes: any JSON object (OpenAI's JSON mode), or the objects a JSON Schema allows.

`JsonGrammar.feed(state, byte)` says what one more byte leaves, or None where no valid document continues that way;
structured.py turns that into the tokens allowed at each position. A state is a tuple (mode, aux, spaces, stack):
`mode` what the grammar expects next, `aux` that mode's detail, `spaces` the whitespace run so far (capped at
MAX_SPACES: a small model under a JSON mask otherwise pads with newlines until it runs out of tokens), `stack` the
open containers as frames (kind "o" or "a", the container's schema node, the last property written or the items
so far). States are hashable, so masks are kept per state.

A schema compiles into nodes (`compile_schema`): objects write their properties in the schema's order (optional
ones may be skipped, required ones may not; no others, as OpenAI's strict mode asks), arrays their items between
minItems and maxItems, strings any text between minLength and maxLength characters, numbers a value in their range
(minimum, maximum, exclusiveMinimum, exclusiveMaximum: each digit only where the range can still be met, written
without an exponent), `enum` and `const` exactly one of their values, `anyOf` / `oneOf` / a list of types one
alternative, chosen by its first byte, or by a first property that is a constant of each (a tagged union).
Keywords the grammar cannot enforce (pattern, format, multipleOf, ...) are refused in one line rather than silently
ignored: whatever the grammar lets through validates against the schema. One keyword is dflash's own: a string's
`x-grammar`, EBNF or Lark text (ebnf.py) its characters must match, as a pattern's must (custom tools' grammars).
Strings hold valid UTF-8 only, so the text always decodes.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from .errors import UserError
from .patterns import FORMATS, INFINITE, Pattern, compile_pattern, format_pattern

MAX_SPACES = 32  # consecutive whitespace bytes between structural tokens

(START, OBJECT_OPEN, KEY_NEXT, COLON, VALUE, ARRAY_OPEN, AFTER_VALUE, STRING, ESCAPE, UNICODE, UTF8, MINUS, ZERO,
 INTEGER, POINT, FRACTION, EXP_MARK, EXP_SIGN, EXPONENT, CHOICE, DONE, TEXT, PROSE, LITERAL, DOCUMENT,
 BETWEEN, THINK_OPEN, THINKING, THOUGHT) = range(29)
THINK_TAGS = (b"<think>", b"</think>")  # a reasoning model's thinking, before its answer (reasoning.py)
OPEN, CLOSE, NEXT = range(3)  # a framed grammar's literals (Frame): the opener, the closer, a separator and opener
WHITESPACE = frozenset(b" \t\n\r")
HEX = frozenset(b"0123456789abcdefABCDEF")
SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
ESCAPED = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 0x08, ord("f"): 0x0C, ord("n"): 0x0A,
           ord("r"): 0x0D, ord("t"): 0x09}  # a simple escape's character
QUOTE, BACKSLASH = ord('"'), ord("\\")
# A held string (one a pattern checks) spells each character one way, as json.dumps does: printable ASCII as itself
# (but \" and \\), and \u only for the rest. So a pattern's fixed text leaves one byte at a time, which
# structured.py forces and drafts free; any other spelling would be a second way at every character.
HELD_ESCAPES = frozenset(b'"\\bfnrtu')  # not \/
UNICODE_ESCAPED = ((0, 0x1F), (0x7F, 0xD7FF), (0xE000, 0xFFFF))  # what \u writes in a held string (no surrogates)
PLAIN_HELD = [byte for byte in range(0x20, 0x7F) if byte not in b'"\\']  # written as themselves in a held string
MAX_HELD_ROWS = 4096  # pattern state sets a held string's table may hold (JsonGrammar.held_table)
# a number's modes: byte class -> next mode; the modes where a number may end (the byte then read after the value)
NUMBER_MOVES = {
    MINUS: {"0": ZERO, "d": INTEGER},
    ZERO: {".": POINT, "e": EXP_MARK},
    INTEGER: {"0": INTEGER, "d": INTEGER, ".": POINT, "e": EXP_MARK},
    POINT: {"0": FRACTION, "d": FRACTION},
    FRACTION: {"0": FRACTION, "d": FRACTION, "e": EXP_MARK},
    EXP_MARK: {"+": EXP_SIGN, "0": EXPONENT, "d": EXPONENT},
    EXP_SIGN: {"0": EXPONENT, "d": EXPONENT},
    EXPONENT: {"0": EXPONENT, "d": EXPONENT},
}
NUMBER_ENDS = frozenset({ZERO, INTEGER, FRACTION, EXPONENT})
BYTE_CLASS = {**{b: "d" for b in b"123456789"}, ord("0"): "0", ord("."): ".", ord("e"): "e", ord("E"): "e",
              ord("+"): "+", ord("-"): "+"}
START_STATE = (START, 0, 0, ())


@dataclass(frozen=True)
class Bounds:
    """A number's range (minimum, maximum, exclusiveMinimum, exclusiveMaximum): each end None where unbounded, and
    open where exclusive. Values compare exactly (as fractions of the decimal text), so the grammar never lets
    through a number a validator comparing floats would refuse."""

    low: Fraction | None = None
    high: Fraction | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: Fraction) -> bool:
        return ((self.low is None or value > self.low or value == self.low and not self.low_open)
                and (self.high is None or value < self.high or value == self.high and not self.high_open))

    def reachable(self, text: str, integer: bool) -> bool:
        """Whether a number that starts with `text` (no exponent) can still end within the range."""
        negative = text.startswith("-")
        cap = (None if self.low is None else -self.low) if negative else self.high  # the largest magnitude allowed
        for low, high, high_open in _magnitudes(text.removeprefix("-"), integer):
            if cap is not None and low > cap:  # this one and every later one lie beyond the range
                return False
            values = (None if high is None else -high, high_open, -low, False) if negative else \
                (low, False, high, high_open)
            if self._meets(*values, integer):
                return True
        return False

    def _meets(self, low, low_open, high, high_open, integer: bool) -> bool:
        """Whether [low, high] (None: unbounded; open ends excluded) holds a value (an integer) within the range."""
        if self.low is not None and (low is None or self.low > low or self.low == low and self.low_open):
            low, low_open = self.low, self.low_open
        if self.high is not None and (high is None or self.high < high or self.high == high and self.high_open):
            high, high_open = self.high, self.high_open
        if integer and low is not None:
            least = math.ceil(low) + (1 if low_open and low == math.ceil(low) else 0)
            low, low_open = Fraction(least), False
        if low is None or high is None:
            return True
        return low < high or low == high and not (low_open or high_open)


def _magnitudes(body: str, integer: bool):
    """The magnitudes a number that starts with `body` (its sign taken off) can reach, as intervals (low, high,
    high_open), high None where unbounded: a whole part's further digits make it 10, 100, ... times larger, each
    scale an interval of its own; a fraction's digits keep it within its last digit's step."""
    whole, point, fraction = body.partition(".")
    if not whole:
        yield Fraction(0), None, False
    elif point:
        step = Fraction(1, 10 ** len(fraction))
        start = Fraction(int(whole + fraction)) * step
        yield start, start + step, True
    elif whole == "0":
        yield Fraction(0), Fraction(0 if integer else 1), not integer
    else:
        value, scale = int(whole), 1
        while True:
            yield Fraction(value * scale), Fraction((value + 1) * scale - integer), not integer
            scale *= 10


@dataclass(frozen=True)
class Frame:
    """Documents written between tags, as chat templates' tool formats write calls: `tag` + `after_tag` opens each
    document, `closer` follows it, `separator` comes between a closer and the next opener. `prose`: free text may
    come first, and the tag, wherever it is written in it, opens a document; `repeat`: documents may follow one
    another (else the output ends after the first). Nothing but these bytes around the documents."""

    tag: bytes
    after_tag: bytes
    closer: bytes
    separator: bytes
    prose: bool
    repeat: bool

    def literal(self, which: int) -> bytes:
        opener = self.tag + self.after_tag
        return (opener, self.closer, self.separator + opener)[which]


def tag_matched(tag: bytes, matched: int, byte: int) -> int:
    """In free text, the bytes of `tag` matched after `matched` of them and then `byte`: the longest end of what was
    read that begins the tag (a tag may start inside a near miss)."""
    read = tag[:matched] + bytes([byte])
    for start in range(len(read)):
        if tag.startswith(read[start:]):
            return len(read) - start
    return 0


@dataclass(frozen=True)
class Node:
    """One schema node. kind: any, object, array, string, number, integer, boolean, null, choice, union or tagged
    (objects told apart by their first property, a constant: the value read there picks the object's node)."""

    kind: str
    keys: tuple[bytes, ...] = ()  # object: its properties' names as JSON writes them, quotes included, in order
    values: tuple[int, ...] = ()  # object: each property's node; union: the alternatives' nodes
    required: tuple[bool, ...] = ()
    free: int = -1  # object without properties: the node of any key's value
    items: int = -1  # array: the node of its items
    min_items: int = 0
    max_items: int | None = None
    choices: tuple[bytes, ...] = ()  # choice, tagged: the values as JSON writes them
    branches: tuple[int, ...] = ()  # tagged: the object node each of `choices` picks
    bounds: Bounds | None = None  # number, integer: their range (no exponent then)
    min_length: int = 0  # string: characters (code points) at least and at most
    max_length: int | None = None
    pattern: Pattern | None = None  # string: a pattern (or format, or x-grammar) it matches (patterns.py, ebnf.py)

    @property
    def checked(self) -> bool:
        return self.kind == "string" and (self.min_length > 0 or self.max_length is not None or bool(self.pattern))

    def first_bytes(self, nodes: list[Node], within: frozenset = frozenset()) -> frozenset[int]:
        """The bytes a value of this node can start with (unions need their alternatives' to be apart)."""
        starts = {"any": b'{["-0123456789tfn', "object": b"{", "tagged": b"{", "array": b"[", "string": b'"', "boolean": b"tf",
                  "number": b"-0123456789", "integer": b"-0123456789", "null": b"n"}
        if self.kind == "choice":
            return frozenset(c[0] for c in self.choices)
        if self.kind == "union":
            if id(self) in within:
                raise UserError("a union that is its own alternative (through $refs) has no first byte")
            return frozenset().union(*(nodes[v].first_bytes(nodes, within | {id(self)}) for v in self.values))
        return frozenset(starts[self.kind])


ANY, ANY_OBJECT, ANY_ARRAY = 0, 1, 2
BUILTIN_NODES = [Node("any"), Node("object", free=ANY), Node("array", items=ANY)]
LITERALS = (b"true", b"false", b"null")


def utf8_lead(byte: int) -> tuple[int, int, int] | None:
    """A UTF-8 lead byte's continuation bytes to come and the range of the first (strict: no overlong forms, no
    surrogates, nothing past U+10FFFF, as Python's decoder)."""
    if 0xC2 <= byte <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= byte <= 0xEF:
        return 2, 0xA0 if byte == 0xE0 else 0x80, 0x9F if byte == 0xED else 0xBF
    if 0xF0 <= byte <= 0xF4:
        return 3, 0x90 if byte == 0xF0 else 0x80, 0x8F if byte == 0xF4 else 0xBF
    return None


class ByteGrammar:
    """What every grammar over an output's bytes shares (this one's, regex_grammar's): several bytes fed at once,
    and a reasoning model's thinking first. `thinking`: "open" where the prompt opened the thinking, "optional" where
    the output may open it with `<think>` (THINK_OPEN, aux: the tag's bytes matched), None for none; the thought is
    free text up to `</think>` (THINKING, aux: its bytes matched), then whitespace (THOUGHT), then the grammar from
    its own first state `start`."""

    start: tuple = START_STATE
    thinking: str | None = None
    words_after_thought = False  # the grammar's start takes whitespace itself (a framed grammar's words)

    def feed(self, state: tuple, byte: int) -> tuple | None:
        raise NotImplementedError

    def may_end(self, state: tuple) -> bool:
        raise NotImplementedError

    def after_special(self, state: tuple) -> tuple | None:
        raise NotImplementedError

    def ascii_table(self, state: tuple):
        """A table of the moves ASCII bytes make from `state` (regex_grammar.PatternGrammar's), or None: a vocabulary
        then walks its tokens one by one."""
        return None

    def feed_bytes(self, state: tuple | None, data: bytes) -> tuple | None:
        """The state after `data`, or None where the grammar refuses it."""
        for byte in data:
            if state is None:
                return None
            state = self.feed(state, byte)
        return state

    def first_state(self) -> tuple:
        return {"open": (THINKING, 0, 0, ()), "optional": (THINK_OPEN, 0, 0, ())}.get(self.thinking, self.start)

    @staticmethod
    def in_thought(state: tuple) -> bool:
        return state[0] in (THINK_OPEN, THINKING, THOUGHT)

    def thought_may_end(self, state: tuple) -> bool:
        """may_end of a thinking state: never inside the thought; elsewhere as the state it stands for."""
        if state[0] == THINKING:
            return False
        other = self.thought_delegate(state)[0]
        return other is not None and self.may_end(other)

    def thought_delegate(self, state: tuple) -> tuple[tuple | None, bytes] | None:
        """delegate of a thinking state: THOUGHT reads as the grammar's start but for whitespace; THINK_OPEN, the
        thinking's tag begun, as the start after the tag's bytes so far but for the tag's next byte."""
        if state[0] == THOUGHT:
            return self.start, bytes(sorted(WHITESPACE))
        if state[0] == THINK_OPEN:
            return self.feed_bytes(self.start, THINK_TAGS[0][:state[1]]), THINK_TAGS[0][state[1]:state[1] + 1]
        return None

    def thought_after_special(self, state: tuple) -> tuple | None:
        """after_special of a thinking state: text inside the thought; elsewhere as the state it stands for."""
        if state[0] == THINKING:
            return (THINKING, 0, 0, ())
        other = self.thought_delegate(state)[0]
        return None if other is None else self.after_special(other)

    def feed_thought(self, mode: int, aux: int, spaces: int, byte: int) -> tuple | None:
        """A byte of a reasoning model's thinking, or the whitespace after it: the grammar starts after that."""
        if mode == THINK_OPEN:  # the output may open its thinking; bytes that turn out not to are the grammar's
            if THINK_TAGS[0][aux] == byte:
                return (THINKING, 0, 0, ()) if aux + 1 == len(THINK_TAGS[0]) else (THINK_OPEN, aux + 1, 0, ())
            return self.feed_bytes(self.start, THINK_TAGS[0][:aux] + bytes([byte]))
        if mode == THINKING:
            matched = tag_matched(THINK_TAGS[1], aux, byte)
            if matched < len(THINK_TAGS[1]):
                return (THINKING, matched, 0, ())
            return self.start if self.words_after_thought else (THOUGHT, 0, 0, ())
        if byte in WHITESPACE:
            return (THOUGHT, 0, spaces + 1, ()) if spaces < MAX_SPACES else None
        return self.feed(self.start, byte)


class JsonGrammar(ByteGrammar):
    """The automaton of one grammar: `nodes` (BUILTIN_NODES first) and the root's node (an object or an array).
    `key` names the grammar in mask caches. `text_otherwise`: an output whose first byte cannot start the document
    is free text instead (TEXT takes any byte; a reply that may call tools or answer in words). `frame`: documents
    between tags instead (Frame; a chat template's tool calls), the modes PROSE (aux: the tag's bytes matched so far),
    LITERAL (aux: (OPEN, CLOSE or NEXT, its bytes matched)), DOCUMENT (a document's first byte), DONE (aux 0: a
    document whole, its closer to come; 1: the output whole) and BETWEEN (a closer written, another document may
    follow). `thinking`: the output thinks first, free text up to `</think>`, and the grammar holds what follows it
    (after whitespace): "open" where the prompt opened the thinking, "optional" where the output may open it with
    `<think>` (THINK_OPEN, aux: the tag's bytes matched; THINKING, aux: `</think>`'s; THOUGHT: whitespace after
    it)."""

    def __init__(self, nodes: list[Node], root: int, key: str, text_otherwise: bool = False,
                 frame: Frame | None = None, thinking: str | None = None):
        self.nodes, self.root, self.key, self.text_otherwise, self.frame = nodes, root, key, text_otherwise, frame
        self.thinking = thinking
        self.words_after_thought = frame is not None and frame.prose
        self.initial = self.first_state()
        self._held: dict[int, dict] = {}  # a held string's node -> its table's rows (held_table)

    def thinking_first(self, thinking: str | None) -> "JsonGrammar":
        """This grammar after a reasoning model's thinking (`thinking` "open" or "optional"; None: itself)."""
        if thinking is None:
            return self
        if thinking not in ("open", "optional"):
            raise ValueError(f"thinking must be open or optional, got {thinking!r}")
        return _thinking_first(self, thinking)

    def may_end(self, state: tuple) -> bool:
        """Whether the output may end after `state`: the document is whole, or the output is free text."""
        if self.in_thought(state):
            return self.thought_may_end(state)
        if self.frame is not None:
            return state[0] in (PROSE, BETWEEN) or state[0] == START and self.frame.prose or self.finished(state)
        return state[0] in (DONE, TEXT) or state[0] == START and self.text_otherwise

    def free_text_tag(self, state: tuple) -> bytes | None:
        """The tag that ends free text where `state` is in it (a framed grammar's words before its calls, a
        reasoning model's thinking), else None."""
        if state[0] == THINKING:
            return THINK_TAGS[1]
        if self.frame is not None and self.frame.prose and state[0] in (PROSE, START):
            return self.frame.tag
        return None

    def delegate(self, state: tuple) -> tuple[tuple | None, bytes] | None:
        """Where `state` reads every next byte but a few as another state does: (that state, None where such bytes are
        refused; the few bytes): the thinking's states only (thought_delegate), None elsewhere. A token that opens
        with another byte is the other state's (structured.py reuses its mask)."""
        return self.thought_delegate(state)

    def after_special(self, state: tuple) -> tuple | None:
        """The state after a special token (one without bytes of its own): text in free text, where it breaks any
        tag begun; refused elsewhere."""
        if state[0] == TEXT:
            return state
        if self.in_thought(state):
            return self.thought_after_special(state)
        return None if self.free_text_tag(state) is None else (PROSE, 0, 0, ())

    def finished(self, state: tuple) -> bool:
        """Whether nothing but the output's end may come after `state`."""
        return state[0] == DONE and (self.frame is None or state[1] == 1)

    def feed(self, state: tuple, byte: int) -> tuple | None:
        """The state after one more byte, or None where no valid document continues that way."""
        mode, aux, spaces, stack = state
        if mode == TEXT:
            return state
        if mode in (THINK_OPEN, THINKING, THOUGHT):
            return self.feed_thought(mode, aux, spaces, byte)
        if self.frame is not None and (mode in (PROSE, LITERAL, DOCUMENT, BETWEEN, DONE) or mode == START):
            return self._framed(mode, aux, byte)
        if mode == STRING:  # aux: 1 in a key (of an object of any keys), 0 in a value, (node, characters, pattern
            # states) in a checked one (a length or a pattern)
            if byte == QUOTE:
                if aux == 1:
                    return (COLON, self.nodes[stack[-1][1]].free, 0, stack)
                return (AFTER_VALUE, 0, 0, stack) if aux == 0 or self._string_done(aux) else None
            if byte < 0x20:  # raw control characters are not allowed in a string
                return None
            checked = aux not in (0, 1)
            if checked:  # a checked string counts each character at its first byte
                aux = self._one_more(aux)
                if aux is None:
                    return None
            patterned = checked and aux[2] is not None
            if byte == BACKSLASH:  # in a pattern: an escape writes " \ or a character \u may write (HELD_ESCAPES)
                if patterned and not (self._may_take(aux, QUOTE, QUOTE) or self._may_take(aux, BACKSLASH, BACKSLASH)
                                      or self._may_escape(aux, 0, 0xFFFF)):
                    return None
                return (ESCAPE, aux, 0, stack)
            if byte < 0x80:
                aux = self._matched(aux, byte) if patterned else aux
                return None if aux is None else (STRING, aux, 0, stack)
            lead = utf8_lead(byte)
            if lead is None:
                return None
            if not patterned:
                return (UTF8, (aux, *lead), 0, stack)
            left, low, high = lead
            bits = byte & (0x7F >> (left + 1))
            shift = 6 * (left - 1)
            if not self._may_take(aux, (bits << 6 | low & 0x3F) << shift, ((bits << 6 | high & 0x3F) + 1 << shift) - 1):
                return None
            return (UTF8, (aux, *lead, bits), 0, stack)
        if mode in (ESCAPE, UNICODE, UTF8):
            return self._escaped_or_multibyte(mode, aux, stack, byte)
        if mode in NUMBER_MOVES:  # aux: 1 for an integer, 0 for a number, (node, text so far) for a bounded one
            return self._number_byte(mode, aux, stack, byte)
        if mode == CHOICE:
            return self._choice_byte(aux, stack, byte)
        if mode == DONE:
            return None
        if byte in WHITESPACE and mode != START:  # the object comes first, as OpenAI's JSON mode writes it
            return (mode, aux, spaces + 1, stack) if spaces < MAX_SPACES else None
        return self._structural(mode, aux, stack, byte)

    def _framed(self, mode: int, aux, byte: int) -> tuple | None:
        """A byte outside the documents of a framed grammar (or a document's first)."""
        frame = self.frame
        if mode == START:
            return self._framed(PROSE, 0, byte) if frame.prose else self._framed(LITERAL, (OPEN, 0), byte)
        if mode == PROSE:
            matched = tag_matched(frame.tag, aux, byte)
            return self._literal(OPEN, matched) if matched == len(frame.tag) else (PROSE, matched, 0, ())
        if mode == DOCUMENT:
            return self._value_start(self.root, (), byte)
        if mode == DONE:
            return None if aux else self._framed(LITERAL, (CLOSE, 0), byte)
        if mode == BETWEEN:
            return self._framed(LITERAL, (NEXT, 0), byte) if frame.repeat else None
        which, matched = aux
        return self._literal(which, matched + 1) if frame.literal(which)[matched] == byte else None

    def _literal(self, which: int, matched: int) -> tuple:
        """The state once `matched` bytes of a frame's literal are read: what follows it once it is whole."""
        if matched < len(self.frame.literal(which)):
            return (LITERAL, (which, matched), 0, ())
        if which != CLOSE:
            return (DOCUMENT, 0, 0, ())
        return (BETWEEN, 0, 0, ()) if self.frame.repeat else (DONE, 1, 0, ())

    def _one_more(self, aux: tuple) -> tuple | None:
        """A checked string's (node, characters, pattern states) after one more character begins; None past its
        maxLength. Without a maxLength the count stops at minLength: longer strings are all alike."""
        at, count, states = aux
        high = self.nodes[at].max_length
        if high is None:
            return (at, min(count + 1, self.nodes[at].min_length), states)
        return (at, count + 1, states) if count < high else None

    def _matched(self, aux: tuple, code: int) -> tuple | None:
        """A patterned string's aux after the character `code`: None where no match goes on that way, or where
        the characters a match still needs pass the maxLength."""
        at, count, states = aux
        node = self.nodes[at]
        following = node.pattern.step(states, code)
        if not following or node.max_length is not None and count + node.pattern.shortest(following) > node.max_length:
            return None
        return (at, count, following)

    def _may_take(self, aux: tuple, low: int, high: int) -> bool:
        """Whether a patterned string may take some character in [low, high] (one still being read)."""
        at, count, states = aux
        high_length = self.nodes[at].max_length
        return self.nodes[at].pattern.can_take(states, low, high, INFINITE if high_length is None
                                               else high_length - count)

    def held_table(self, state: tuple):
        """Where `state` is inside a held string without a maxLength: a table of the moves its plain ASCII characters
        make (printable, but `"` and `\\`, which a held string spells one way each, as itself), as
        regex_grammar.PatternGrammar.ascii_table's: [rows + 1, 128], row n + 1 the pattern's n-th state set met
        from this string's node, each column the row after that byte (0: refused or not plain); with `state`'s row.
        None elsewhere, or past MAX_HELD_ROWS state sets (a vocabulary then walks its tokens)."""
        if state[0] != STRING or state[1] in (0, 1) or state[1][2] is None or self.nodes[state[1][0]].max_length:
            return None
        at, _, states = state[1]
        held = self._held.setdefault(at, {"numbers": {}, "rows": [], "table": None, "full": False})
        if held["full"]:
            return None
        numbers, rows = held["numbers"], held["rows"]
        todo, grew = [states], False
        while todo:
            current = todo.pop()
            if current in numbers:
                continue
            if len(numbers) >= MAX_HELD_ROWS:
                held["full"] = True  # too many to table: walked from now on
                return None
            numbers[current] = len(rows)
            row = [0] * 0x80
            rows.append(row)
            for byte in PLAIN_HELD:
                following = self.nodes[at].pattern.step(current, byte)
                if following:
                    row[byte] = following
                    todo.append(following)
            grew = True
        if grew:  # row 0: refused
            held["table"] = torch.tensor([[0] * 0x80] + [[numbers[cell] + 1 if cell else 0 for cell in row]
                                                          for row in rows], dtype=torch.long)
        return held["table"], numbers[states] + 1

    def _may_escape(self, aux: tuple, low: int, high: int) -> bool:
        """Whether a held string may take a character in [low, high] that \\u may write there (UNICODE_ESCAPED)."""
        return any(self._may_take(aux, max(low, start), min(high, end)) for start, end in UNICODE_ESCAPED
                   if max(low, start) <= min(high, end))

    def _string_done(self, aux: tuple) -> bool:
        at, count, states = aux
        return count >= self.nodes[at].min_length and (states is None or self.nodes[at].pattern.accepts(states))

    def _escaped_or_multibyte(self, mode: int, aux, stack: tuple, byte: int) -> tuple | None:
        """Escapes and multi-byte characters; in a patterned string they carry the character's code so far, which
        the pattern reads once it is whole."""
        if mode == ESCAPE:  # aux: the string's
            patterned = aux not in (0, 1) and aux[2] is not None
            if patterned and (byte not in HELD_ESCAPES or byte == ord("u") and not self._may_escape(aux, 0, 0xFFFF)):
                return None
            if byte in SIMPLE_ESCAPES:
                aux = self._matched(aux, ESCAPED[byte]) if patterned else aux
                return None if aux is None else (STRING, aux, 0, stack)
            return (UNICODE, (aux, 4, 0) if patterned else (aux, 4), 0, stack) if byte == ord("u") else None
        if mode == UNICODE:  # aux: (the string's, hex digits to come[, the code so far])
            inner, left = aux[:2]
            # a checked string counts an escape as one character: a surrogate pair (two escapes, one character) could
            # pass a minLength it does not reach, so \uD... is refused there (the character itself is not)
            if byte not in HEX or left == 4 and inner not in (0, 1) and byte in b"dD":
                return None
            if len(aux) == 2:
                return (STRING, inner, 0, stack) if left == 1 else (UNICODE, (inner, left - 1), 0, stack)
            code = aux[2] * 16 + int(chr(byte), 16)
            shift = 4 * (left - 1)
            if not self._may_escape(inner, code << shift, (code + 1 << shift) - 1):
                return None
            if left > 1:
                return (UNICODE, (inner, left - 1, code), 0, stack)
            inner = self._matched(inner, code)
            return None if inner is None else (STRING, inner, 0, stack)
        inner, left, low, high = aux[:4]  # UTF8: inside a multi-byte character, the next byte's range[, code so far]
        if not low <= byte <= high:
            return None
        if len(aux) == 4:
            return (STRING, inner, 0, stack) if left == 1 else (UTF8, (inner, left - 1, 0x80, 0xBF), 0, stack)
        code = aux[4] << 6 | byte & 0x3F
        if left > 1:
            shift = 6 * (left - 1)
            return (UTF8, (inner, left - 1, 0x80, 0xBF, code), 0, stack) \
                if self._may_take(inner, code << shift, (code + 1 << shift) - 1) else None
        inner = self._matched(inner, code)
        return None if inner is None else (STRING, inner, 0, stack)

    def _number_byte(self, mode: int, aux, stack: tuple, byte: int) -> tuple | None:
        """A byte inside a number: it goes on (a bounded one only where its range can still be met) or the number
        ends (a bounded one only within its range) and the byte comes after it."""
        bounded = not isinstance(aux, int)
        integer = self.nodes[aux[0]].kind == "integer" if bounded else aux
        following = NUMBER_MOVES[mode].get(BYTE_CLASS.get(byte, ""))
        if following is not None and not ((integer or bounded) and following == EXP_MARK) \
                and not (integer and following == POINT):
            if not bounded:
                return (following, aux, 0, stack)
            text = aux[1] + chr(byte)
            return (following, (aux[0], text), 0, stack) if self.nodes[aux[0]].bounds.reachable(text, integer) \
                else None
        if mode not in NUMBER_ENDS or bounded and not self.nodes[aux[0]].bounds.holds(Fraction(aux[1])):
            return None
        return self.feed((AFTER_VALUE, 0, 0, stack), byte)

    def _structural(self, mode: int, aux, stack: tuple, byte: int) -> tuple | None:
        """A byte other than whitespace where the grammar expects punctuation or a value."""
        if mode == START:
            opened = self._value_start(self.root, (), byte)
            return (TEXT, 0, 0, ()) if opened is None and self.text_otherwise else opened
        if mode == COLON:  # aux: the value's node
            return (VALUE, aux, 0, stack) if byte == ord(":") else None
        if mode == VALUE:
            return self._value_start(aux, stack, byte)
        kind, at, done = stack[-1]
        node = self.nodes[at]
        if mode in (OBJECT_OPEN, KEY_NEXT):
            if byte == QUOTE:
                return (STRING, 1, 0, stack) if node.free >= 0 else self._choice(self._next_keys(node, done), 1,
                                                                                  True, stack)
            return _closed(stack) if mode == OBJECT_OPEN and byte == ord("}") and self._may_close(node, done) else None
        if mode == ARRAY_OPEN:
            if byte == ord("]"):
                return _closed(stack) if node.min_items == 0 else None
            if node.max_items == 0:
                return None
            return self._value_start(node.items, stack[:-1] + (("a", at, 1),), byte)
        # AFTER_VALUE
        if kind == "o":
            if byte == ord(","):
                return (KEY_NEXT, 0, 0, stack) if node.free >= 0 or self._next_keys(node, done) else None
            return _closed(stack) if byte == ord("}") and self._may_close(node, done) else None
        if byte == ord(","):
            return (VALUE, node.items, 0, stack[:-1] + (("a", at, done + 1),)) if node.max_items is None \
                or done < node.max_items else None
        return _closed(stack) if byte == ord("]") and done >= node.min_items else None

    @staticmethod
    def _next_keys(node: Node, done: int) -> tuple[bytes, ...]:
        """The properties that may come after property `done`: the later ones up to the first required one."""
        keys = []
        for key, required in zip(node.keys[done + 1:], node.required[done + 1:]):
            keys.append(key)
            if required:
                break
        return tuple(keys)

    @staticmethod
    def _may_close(node: Node, done: int) -> bool:
        return node.free >= 0 or not any(node.required[done + 1:])

    def _value_start(self, at: int, stack: tuple, byte: int) -> tuple | None:
        node = self.nodes[at]
        if node.kind == "union":  # the alternatives start apart (compile_schema checks), so one at most goes on
            for alternative in node.values:
                state = self._value_start(alternative, stack, byte)
                if state is not None:
                    return state
            return None
        if node.kind == "choice":
            return self._choice(node.choices, 0, False, stack, byte)
        generic = node.kind == "any"
        if byte == ord("{") and (generic or node.kind in ("object", "tagged")):
            return (OBJECT_OPEN, 0, 0, stack + (("o", ANY_OBJECT if generic else at, -1),))
        if byte == ord("[") and (generic or node.kind == "array"):
            return (ARRAY_OPEN, 0, 0, stack + (("a", ANY_ARRAY if generic else at, 0),))
        if byte == QUOTE and (generic or node.kind == "string"):
            return (STRING, (at, 0, node.pattern and node.pattern.start) if node.checked else 0, 0, stack)
        mode = MINUS if byte == ord("-") else ZERO if byte == ord("0") else \
            INTEGER if ord("1") <= byte <= ord("9") else None
        if mode is not None and (generic or node.kind in ("number", "integer")):
            integer = int(node.kind == "integer")
            if node.bounds is None:
                return (mode, integer, 0, stack)
            text = chr(byte)
            return (mode, (at, text), 0, stack) if node.bounds.reachable(text, bool(integer)) else None
        if generic or node.kind in ("boolean", "null"):
            literals = LITERALS if generic else (b"true", b"false") if node.kind == "boolean" else (b"null",)
            return self._choice(literals, 0, False, stack, byte)
        return None

    def _choice(self, choices: tuple[bytes, ...], at: int, key: bool, stack: tuple, byte: int | None = None):
        """Matching one of `choices` (enum values, or an object's next keys when `key`) with `at` bytes read; `byte`
        the next one, if any."""
        if not choices:  # nothing may come: refused here, so that no state is a dead end
            return None
        state = (CHOICE, (choices, at, key), 0, stack)
        return state if byte is None else self._choice_byte(state[1], stack, byte)

    def _choice_byte(self, aux, stack: tuple, byte: int) -> tuple | None:
        choices, at, key = aux
        going = tuple(c for c in choices if len(c) > at and c[at] == byte)
        if not going:  # a value that is whole here (enum 1 beside 12) ends, and the byte comes after it
            whole = [c for c in choices if len(c) == at]
            return self.feed(self._after_choice(whole[0], key, stack), byte) if whole else None
        if all(len(c) == at + 1 for c in going):
            return self._after_choice(going[0], key, stack)
        return (CHOICE, (going, at + 1, key), 0, stack)

    def _after_choice(self, chosen: bytes, key: bool, stack: tuple) -> tuple:
        _, at, _ = stack[-1]
        node = self.nodes[at]
        if not key:
            if node.kind == "tagged":  # the first property's value: the object goes on as the node it picks
                return (AFTER_VALUE, 0, 0, stack[:-1] + (("o", node.branches[node.choices.index(chosen)], 0),))
            return (AFTER_VALUE, 0, 0, stack)
        index = node.keys.index(chosen)
        return (COLON, node.values[index], 0, stack[:-1] + (("o", at, index),))


def _closed(stack: tuple) -> tuple:
    """The state once the innermost container closes: the document is whole when it was the outermost."""
    return (DONE, 0, 0, ()) if len(stack) == 1 else (AFTER_VALUE, 0, 0, stack[:-1])


@functools.lru_cache(maxsize=32)
def _thinking_first(grammar: JsonGrammar, thinking: str) -> JsonGrammar:
    return JsonGrammar(grammar.nodes, grammar.root, f"{grammar.key}|thinking-{thinking}", grammar.text_otherwise,
                       grammar.frame, thinking)


def complete(state: tuple | None) -> bool:
    return state is not None and state[0] == DONE


JSON_OBJECT = JsonGrammar(BUILTIN_NODES, ANY_OBJECT, "json_object")


# ---- JSON Schema -> nodes ------------------------------------------------------------------------------------------
GRAMMAR_KEY = "x-grammar"  # a string's characters match EBNF or Lark text (dflash's own keyword)
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
               "writeOnly", "$defs", "definitions", "strict", "discriminator"}
ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum", "const",
            "anyOf", "oneOf", "$ref", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
            "maxLength", "pattern", "format", GRAMMAR_KEY}
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


@functools.lru_cache(maxsize=32)
def _compiled(text: str, text_otherwise: bool, frame: Frame | None) -> JsonGrammar:
    schema = json.loads(text)
    compiler = _SchemaCompiler(schema)
    root = compiler.node(schema, "#")
    compiler.check_unions()
    if not compiler.nodes[root].first_bytes(compiler.nodes) <= {ord("{"), ord("[")}:
        raise UserError("a JSON schema for structured output must describe an object (as OpenAI's json_schema asks) "
                        "or an array at its root")
    kind = f"framed{frame}" if frame else "schema-or-text" if text_otherwise else "schema"
    return JsonGrammar(compiler.nodes, root, f"{kind}:{text}", text_otherwise, frame)


def compile_schema(schema, text_otherwise: bool = False, frame: Frame | None = None) -> JsonGrammar:
    """The grammar of the documents `schema` (a JSON Schema, as a dict) allows; UserError for what it cannot enforce.
    `text_otherwise`: free text too, where the output's first byte cannot start a document; `frame`: documents
    between tags (JsonGrammar)."""
    if not isinstance(schema, dict):
        raise UserError(f"a JSON schema must be an object, got {type(schema).__name__}")
    too_deep = "the JSON schema (or a pattern in it) is nested too deeply to compile"
    try:
        text = json.dumps(schema)  # its properties in order: they are written in that order
    except (TypeError, ValueError) as error:
        raise UserError(f"the JSON schema is not JSON: {error}") from None
    except RecursionError:
        raise UserError(too_deep) from None
    try:
        return _compiled(text, text_otherwise, frame)
    except RecursionError:
        raise UserError(too_deep) from None


ANY_OBJECT_SCHEMA = {"type": "object"}
MAX_RELAXATIONS = 64  # nodes a lenient schema may open up, each to any value, before it becomes any object


def enforceable(schema, roots: tuple[str, ...] = ("object", "tagged")) -> dict:
    """What a grammar can hold of a JSON schema that need not be enforced whole (a tool's parameters, or a response
    format, unless strict: OpenAI holds those loosely): keywords it cannot enforce dropped (formats it does not know,
    patterns it cannot read, `not`, `allOf`, ...), then each node it still refuses opened up to any value, and an
    object of any keys where nothing else compiles. The result always compiles, to a grammar whose root is of
    `roots`' kinds. Kept by the schema's text: requests send the same tools again and again."""
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError):
        return dict(ANY_OBJECT_SCHEMA)
    return json.loads(_enforceable_text(text, roots))


@functools.lru_cache(maxsize=256)
def _enforceable_text(text: str, roots: tuple[str, ...]) -> str:
    """enforceable of a schema's JSON text, as JSON text (a fresh copy each time it is read)."""
    schema = json.loads(text)
    relaxed = _enforceable_node(schema) if isinstance(schema, dict) else ANY_OBJECT_SCHEMA
    return json.dumps(_relaxed_until_it_compiles(relaxed, roots))


def _relaxed_until_it_compiles(relaxed: dict, roots: tuple[str, ...]) -> dict:
    """Each node the compiler still refuses opened up to any value, until the schema compiles."""
    for _ in range(MAX_RELAXATIONS):
        try:
            grammar = compile_schema(relaxed)
        except UserError as error:
            path = str(error).split(":", 1)[0]
            if not path.startswith("#/") or not _open_up(relaxed, path[2:].split("/")):
                return ANY_OBJECT_SCHEMA
            continue
        return relaxed if grammar.nodes[grammar.root].kind in roots else ANY_OBJECT_SCHEMA
    return ANY_OBJECT_SCHEMA


def _enforceable_node(schema):
    """A schema node with what the compiler refuses outright dropped, recursively."""
    if not isinstance(schema, dict):
        return schema
    node = {key: value for key, value in schema.items() if key in ANNOTATIONS or key in ENFORCED}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            node[key] = {name: _enforceable_node(value) for name, value in node[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = _enforceable_node(node[key])
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            node[key] = [_enforceable_node(value) for value in node[key]]
    if isinstance(node.get("required"), list) and isinstance(node.get("properties"), dict):
        node["required"] = [name for name in node["required"] if name in node["properties"]]
    if node.get("format") is not None and (node["format"] not in FORMATS or "pattern" in node):
        del node["format"]
    if "pattern" in node:
        try:
            compile_pattern(node["pattern"])
        except (UserError, TypeError):
            del node["pattern"]
    if GRAMMAR_KEY in node:
        try:
            _string_grammar(node[GRAMMAR_KEY], "#")
        except UserError:
            del node[GRAMMAR_KEY]
    if any(key in node for key in ("pattern", "format", GRAMMAR_KEY)) and node.get("minLength"):
        del node["minLength"]
    return node


def _open_up(schema: dict, parts: list[str]) -> bool:
    """Replace the node at `parts` (a path the compiler named) with any value; False where it names none."""
    parent, key = None, None
    node = schema
    for part in parts:
        parent, key = node, int(part) if isinstance(node, list) and part.isdigit() else part
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return False
    if parent is None or node == {}:
        return False
    parent[key] = {}
    return True


class _SchemaCompiler:
    def __init__(self, document: dict):
        self.document = document
        self.nodes: list[Node | None] = list(BUILTIN_NODES)
        self.refs: dict[str, int] = {}
        self.unions: dict[int, str] = {}  # union nodes (a $ref's copy of one too) -> their paths

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def node(self, schema, path: str) -> int:
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise UserError(f"{path}: a schema must be an object or true, got {schema!r}")
        unknown = sorted(set(schema) - ANNOTATIONS - ENFORCED)
        if unknown:
            raise UserError(f"{path}: {', '.join(unknown)} cannot be enforced while generating; supported: "
                            f"{', '.join(sorted(ENFORCED))}")
        if "$ref" in schema:
            return self.reference(schema["$ref"], path)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise UserError(f"{path}: enum must be a non-empty list")
            return self.add(Node("choice", choices=tuple(dict.fromkeys(_encoded(v) for v in values))))
        for word in ("anyOf", "oneOf"):
            if word in schema:
                options = schema[word]
                if not isinstance(options, list) or not options:
                    raise UserError(f"{path}: {word} must be a non-empty list of schemas")
                return self.union([self.node(s, f"{path}/{word}/{i}") for i, s in enumerate(options)], path)
        kind = schema.get("type", "object" if "properties" in schema else None)
        if kind is None:
            if set(schema) - ANNOTATIONS:
                raise UserError(f"{path}: give a type (one of {', '.join(TYPES)})")
            return ANY
        if isinstance(kind, list):
            rest = {k: v for k, v in schema.items() if k != "type"}
            return self.union([self.node({**rest, "type": k}, f"{path}/type/{k}") for k in kind], path)
        if kind not in TYPES:
            raise UserError(f"{path}: unknown type {kind!r} (one of {', '.join(TYPES)})")
        if kind == "object":
            return self.object(schema, path)
        if kind == "array":
            return self.array(schema, path)
        if kind in ("number", "integer"):
            return self.add(Node(kind, bounds=_bounds(schema, path, kind == "integer")))
        if kind == "string":
            return self.add(self.string(schema, path))
        return self.add(Node(kind))

    @staticmethod
    def string(schema: dict, path: str) -> Node:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not _whole(low) or high is not None and (not _whole(high) or high < low):
            raise UserError(f"{path}: minLength and maxLength must be whole numbers, minLength <= maxLength")
        given = [key for key in ("pattern", "format", GRAMMAR_KEY) if schema.get(key) is not None]
        if len(given) > 1:
            raise UserError(f"{path}: a string with both a {given[0]} and a {given[1]} cannot be enforced; give one")
        if given and low > 0:
            raise UserError(f"{path}: minLength beside a {given[0]} cannot be enforced; say the length in the "
                            f"{given[0]}")
        if given == [GRAMMAR_KEY]:
            if high is not None:
                raise UserError(f"{path}: maxLength beside an {GRAMMAR_KEY} cannot be enforced")
            return Node("string", pattern=_string_grammar(schema[GRAMMAR_KEY], path))
        source, form = schema.get("pattern"), schema.get("format")
        if source is not None and not isinstance(source, str):
            raise UserError(f"{path}: pattern must be a string, got {source!r}")
        pattern = compile_pattern(source) if source is not None else format_pattern(form, path) if form else None
        return Node("string", min_length=low, max_length=high, pattern=pattern)

    def object(self, schema: dict, path: str) -> int:
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise UserError(f"{path}: properties must be an object and required a list")
        missing = [name for name in required if name not in properties]
        if missing:
            raise UserError(f"{path}: required names properties it does not define: {', '.join(missing)}")
        if not properties:
            extra = schema.get("additionalProperties", True)
            value = ANY if extra is True else self.node(extra, f"{path}/additionalProperties") if extra else -1
            if value < 0:  # additionalProperties false and nothing else: only {}
                return self.add(Node("object"))
            return self.add(Node("object", free=value))
        at = self.add(Node("object"))  # its index first: a property may refer back to it
        values = tuple(self.node(s, f"{path}/properties/{name}") for name, s in properties.items())
        self.nodes[at] = Node("object", keys=tuple(_encoded(name) for name in properties), values=values,
                              required=tuple(name in required for name in properties))
        return at

    def array(self, schema: dict, path: str) -> int:
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(low, int) or low < 0 or high is not None and (not isinstance(high, int) or high < low):
            raise UserError(f"{path}: minItems and maxItems must be whole numbers, minItems <= maxItems")
        items = self.node(schema.get("items", True), f"{path}/items")
        return self.add(Node("array", items=items, min_items=low, max_items=high))

    def union(self, options: list[int], path: str) -> int:
        if len(options) == 1:
            return options[0]
        self.unions[len(self.nodes)] = path  # checked once every node is built (a $ref may be pending)
        return self.add(Node("union", values=tuple(options)))

    def check_unions(self) -> None:
        """Each union's alternatives must start with different bytes: the first byte then picks one, and the
        automaton stays deterministic. Objects whose first property is a required constant that differs (a tagged
        union: a tool call's name, pydantic's discriminated unions) become one node that the constant resolves."""
        for at, path in self.unions.items():
            options = self.tagged(self.nodes[at].values)
            seen: set[int] = set()
            for option in options:
                starts = self.nodes[option].first_bytes(self.nodes)
                if starts & seen:
                    raise UserError(f"{path}: alternatives that can start alike (two strings, two objects without a "
                                    "first property that tells them apart, ...) are not supported; give them different "
                                    "types, or make each object's first property a required const of its own")
                seen |= starts
            self.nodes[at] = Node("union", values=tuple(options)) if len(options) > 1 else self.nodes[options[0]]

    def tagged(self, options: tuple[int, ...]) -> tuple[int, ...]:
        """A union's alternatives with its objects as one tagged node, where their first properties tell them apart
        (the same name, required, a constant of each object's own); unchanged otherwise."""
        objects = [o for o in options if self.nodes[o].kind == "object"]
        if len(objects) < 2:
            return options
        firsts = {self.nodes[o].keys[:1] for o in objects}
        tags = [self.tag_values(self.nodes[o]) for o in objects]
        if len(firsts) != 1 or not all(tags):
            return options
        pairs = [(value, o) for o, values in zip(objects, tags) for value in values]
        if len({value for value, _ in pairs}) < len(pairs):
            return options
        values = tuple(value for value, _ in pairs)
        tag = self.add(Node("choice", choices=values))
        node = self.add(Node("tagged", keys=firsts.pop(), values=(tag,), required=(True,), choices=values,
                             branches=tuple(o for _, o in pairs)))
        return (node,) + tuple(o for o in options if o not in objects)

    def tag_values(self, node: Node) -> tuple[bytes, ...]:
        """The values an object's first property may take where it is a required constant (or enum), else ()."""
        if not node.keys or not node.required[0] or self.nodes[node.values[0]].kind != "choice":
            return ()
        return self.nodes[node.values[0]].choices

    def reference(self, ref, path: str) -> int:
        if ref in self.refs:  # perhaps still being built: a recursive schema
            return self.refs[ref]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UserError(f"{path}: only local $refs (#/$defs/NAME) are supported, got {ref!r}")
        target = self.document
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise UserError(f"{path}: $ref {ref} points at nothing")
            target = target[part]
        at = self.add(None)
        self.refs[ref] = at
        built = self.node(target, ref)
        if self.nodes[built] is None:
            raise UserError(f"{path}: $ref {ref} refers to itself with nothing between")
        self.nodes[at] = self.nodes[built]
        if built in self.unions:  # the copy is a union too: checked (and tagged) as its original
            self.unions[at] = ref
        return at


def _string_grammar(text, path: str):
    """The automaton of a string's x-grammar (ebnf.RuleAutomaton, which has a pattern's interface)."""
    from .ebnf import compile_rules  # ebnf builds on regex_grammar, which builds on this module

    if not isinstance(text, str):
        raise UserError(f"{path}: {GRAMMAR_KEY} must be EBNF or Lark text, got {type(text).__name__}")
    try:
        return compile_rules(text)
    except UserError as error:
        raise UserError(f"{path}: {GRAMMAR_KEY}: {error}") from None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bounds(schema: dict, path: str, integer: bool) -> Bounds | None:
    """A number's range from minimum / maximum and exclusiveMinimum / exclusiveMaximum (numbers, or the older
    booleans that make minimum / maximum exclusive); None where it has none."""
    ends = {}
    for word in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(word)
        if value is None or word.startswith("exclusive") and isinstance(value, bool):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{path}: {word} must be a number, got {value!r}")
        ends[word] = Fraction(str(value))  # the decimal as written: 0.1 is 1/10, as a float compares to it
    if not ends:
        return None
    low, low_open = _tighter(ends.get("minimum"), schema.get("exclusiveMinimum") is True,
                             ends.get("exclusiveMinimum"), max)
    high, high_open = _tighter(ends.get("maximum"), schema.get("exclusiveMaximum") is True,
                               ends.get("exclusiveMaximum"), min)
    bounds = Bounds(low, high, low_open, high_open)
    if not bounds._meets(None, False, None, False, integer):
        raise UserError(f"{path}: no {'integer' if integer else 'number'} lies between its minimum and maximum")
    return bounds


def _tighter(inclusive, inclusive_open: bool, exclusive, pick) -> tuple[Fraction | None, bool]:
    """One end of a range from an inclusive bound (made exclusive by the older boolean form) and an exclusive one."""
    if exclusive is None or inclusive is not None and pick(inclusive, exclusive) == inclusive != exclusive:
        return inclusive, inclusive_open
    return exclusive, True


def _encoded(value) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()
