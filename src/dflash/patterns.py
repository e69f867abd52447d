"""JSON Schema's `pattern` and `format` for strings, as automata over a string's characters (grammar.py runs them
inside a JSON string, after its escapes are decoded).

A pattern is an ECMA-262 regular expression that a valid string contains somewhere (JSON Schema does not anchor
it): `^` and `$` at its ends anchor it, otherwise any text may come before or after. The subset understood:
literals and escaped punctuation, `.`, classes (`[a-z0-9_]`, `[^"]`, `\\d \\w \\s` and their negations, ASCII
characters only, where ECMA's regular expressions and Python's agree), groups (`(...)`, `(?:...)`, named ones:
`(?<name>...)`, Python's `(?P<name>...)`), alternation, and the quantifiers `* + ? {n} {n,} {n,m}` (lazy ones too:
a grammar only asks whether a string matches). Anything else (lookarounds, flags, backreferences, `\\b`, anchors
inside) is refused in one line. It compiles into a nondeterministic automaton (Thompson's construction) whose state
sets the grammar carries; states that cannot reach a match any more are dropped, so a string is refused at its first
character that no match continues, and the fewest characters still needed to match are known (a maxLength beside a
pattern is then never a dead end).

A few `format`s are patterns written out: date (days up to each month's last, February 29 in leap years; years
0001-9999, as Python's dates), time and date-time (RFC 3339 with seconds and an offset, as JSON Schema's formats are), uuid,
email (a conservative shape that email validators accept) and ipv4.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .errors import UserError

NAMED_GROUP = re.compile(r"\?P?<[A-Za-z_][A-Za-z0-9_]*>")  # (?<name>...), ECMA's and Python's (?P<name>...)
MAX_STATES = 4000  # of a pattern's automaton: {n,m} copies what it repeats
MAX_REPEAT = 1000
INFINITE = float("inf")
LINE_BREAKS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
DIGITS = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACES = ((0x09, 0x0D), (0x20, 0x20))


def _ascii_outside(ranges) -> tuple[tuple[int, int], ...]:
    inside = {c for low, high in ranges for c in range(low, high + 1)}
    outside, start = [], None
    for code in range(0x80):
        if code not in inside and start is None:
            start = code
        if (code in inside or code == 0x7F) and start is not None:
            outside.append((start, code if code not in inside else code - 1))
            start = None
    return tuple(outside)


# ASCII only, each negation too: ECMA's \w and \d are ASCII, Python's (a validator's `re`) are Unicode, so the
# characters both agree on are these
CLASS_ESCAPES = {"d": (DIGITS, False), "D": (_ascii_outside(DIGITS), False), "w": (WORD, False),
                 "W": (_ascii_outside(WORD), False), "s": (SPACES, False), "S": (_ascii_outside(SPACES), False)}
CONTROL_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}

_BYTE = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# years 0001-9999 (Python's dates, which pydantic reads them as, have no year 0); February 29 in leap years only:
# those divisible by 4 but not by 100 (the last two digits a multiple of 4 but 00), and those divisible by 400
_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "uuid": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": f"^[A-Za-z0-9_%+-]+(\\.[A-Za-z0-9_%+-]+)*@({_LABEL}\\.)+[A-Za-z]{{2,}}$",
    "ipv4": f"^({_BYTE}\\.){{3}}{_BYTE}$",
}


@dataclass(frozen=True)
class CharSet:
    """Code points in `ranges` (inclusive pairs), or outside them when `negated`."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False

    def __contains__(self, code: int) -> bool:
        return any(low <= code <= high for low, high in self.ranges) != self.negated

    def meets(self, low: int, high: int) -> bool:
        """Whether some code point in [low, high] is in the set."""
        if not self.negated:
            return any(a <= high and b >= low for a, b in self.ranges)
        for a, b in sorted(self.ranges):  # negated: is [low, high] covered by what it excludes?
            if a > low:
                return True
            low = max(low, b + 1)
            if low > high:
                return False
        return True


ANY = CharSet((), negated=True)


class Pattern:
    """A pattern's automaton: `start` the state set before any character; `step` the set after one more, with
    the states that cannot reach a match dropped (empty: refused); `accepts` and `shortest` (the fewest
    characters that still make a match) for a set."""

    def __init__(self, source: str):
        self.source = source
        self.moves: list[list[tuple[CharSet, int]]] = []
        self.empty: list[list[int]] = []  # epsilon edges
        tree, anchored_start, anchored_end = _Parser(source).parse()
        if not anchored_start:
            tree = ("seq", [("repeat", ("chars", ANY), 0, None), tree])
        if not anchored_end:
            tree = ("seq", [tree, ("repeat", ("chars", ANY), 0, None)])
        first, self.final = self._build(tree)
        self.closures = [self._closure(s) for s in range(len(self.moves))]
        self.distance = self._distances()
        self.start = self._alive(self.closures[first])
        self._steps: dict[tuple[frozenset, int], frozenset] = {}

    def accepts(self, states: frozenset) -> bool:
        return self.final in states

    def shortest(self, states: frozenset) -> float:
        return min((self.distance[s] for s in states), default=INFINITE)

    def can_take(self, states: frozenset, low: int, high: int, budget: float = INFINITE) -> bool:
        """Whether some character in [low, high] goes on from `states` towards a match at most `budget` characters
        further: a character still being read (an escape, a multi-byte one) is taken only where it can end well."""
        return any(self.distance[target] <= budget and chars.meets(low, high)
                   for state in states for chars, target in self.moves[state])

    def step(self, states: frozenset, code: int) -> frozenset:
        key = (states, code)
        following = self._steps.get(key)
        if following is None:
            reached = set()
            for state in states:
                for chars, target in self.moves[state]:
                    if code in chars:
                        reached |= self.closures[target]
            following = self._alive(reached)
            if len(self._steps) > 100_000:
                self._steps.clear()
            self._steps[key] = following
        return following

    # ---- construction ----------------------------------------------------------------------------------------
    def _state(self) -> int:
        if len(self.moves) >= MAX_STATES:
            raise UserError(f"pattern {self.source!r} is too large to enforce (its automaton passes {MAX_STATES} "
                            "states); repeat less")
        self.moves.append([])
        self.empty.append([])
        return len(self.moves) - 1

    def _build(self, tree) -> tuple[int, int]:
        """(entry, exit) states of a fragment for `tree`."""
        kind = tree[0]
        if kind == "chars":
            entry, exit_ = self._state(), self._state()
            self.moves[entry].append((tree[1], exit_))
            return entry, exit_
        if kind == "seq":
            entry = exit_ = self._state()
            for part in tree[1]:
                start, end = self._build(part)
                self.empty[exit_].append(start)
                exit_ = end
            return entry, exit_
        if kind == "alt":
            entry, exit_ = self._state(), self._state()
            for option in tree[1]:
                start, end = self._build(option)
                self.empty[entry].append(start)
                self.empty[end].append(exit_)
            return entry, exit_
        _, inner, low, high = tree  # repeat
        entry = exit_ = self._state()
        for _ in range(low):
            start, end = self._build(inner)
            self.empty[exit_].append(start)
            exit_ = end
        if high is None:  # a loop: back to its start after each time
            start, end = self._build(inner)
            self.empty[exit_].append(start)
            self.empty[end].append(start)
            after = self._state()
            self.empty[exit_].append(after)
            self.empty[end].append(after)
            return entry, after
        after = self._state()
        for _ in range(high - low):  # each optional copy may be skipped to the end
            self.empty[exit_].append(after)
            start, end = self._build(inner)
            self.empty[exit_].append(start)
            exit_ = end
        self.empty[exit_].append(after)
        return entry, after

    def _closure(self, state: int) -> frozenset:
        seen, todo = {state}, [state]
        while todo:
            for target in self.empty[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return frozenset(seen)

    def _distances(self) -> list[float]:
        """Each state's fewest characters to the final state (INFINITE where it cannot get there)."""
        distance = [INFINITE] * len(self.moves)
        distance[self.final] = 0
        changed = True
        while changed:  # relaxed until stable: automata of a pattern are small
            changed = False
            for state in range(len(self.moves)):
                best = min([distance[t] for t in self.empty[state]] + [distance[t] + 1 for _, t in self.moves[state]]
                           + [distance[state]])
                if best < distance[state]:
                    distance[state], changed = best, True
        return distance

    def _alive(self, states) -> frozenset:
        return frozenset(s for s in states if self.distance[s] < INFINITE)


@functools.lru_cache(maxsize=64)
def compile_pattern(source: str) -> Pattern:
    return Pattern(source)


def format_pattern(name: str, path: str) -> Pattern:
    if name not in FORMATS:
        raise UserError(f"{path}: format {name!r} cannot be enforced while generating; supported: "
                        f"{', '.join(sorted(FORMATS))}")
    return compile_pattern(FORMATS[name])


class _Parser:
    """A recursive-descent reader of the pattern subset, into trees: ("chars", CharSet), ("seq", [trees]),
    ("alt", [trees]), ("repeat", tree, low, high or None)."""

    def __init__(self, source: str):
        self.source, self.at = source, 0

    def fail(self, what: str):
        raise UserError(f"pattern {self.source!r}: {what} (at {self.at}) cannot be enforced while generating; "
                        "supported: literals, ., classes, \\d \\w \\s, groups, |, * + ? {n,m}, ^ and $ at the ends")

    def parse(self) -> tuple:
        anchored_start = self.source.startswith("^")
        self.at = int(anchored_start)
        tree = self.alternation()
        anchored_end = self.at < len(self.source) and self.source[self.at] == "$"
        self.at += anchored_end
        if self.at != len(self.source):
            self.fail(f"{self.source[self.at]!r}")
        return tree, anchored_start, anchored_end

    def peek(self) -> str | None:
        return self.source[self.at] if self.at < len(self.source) else None

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.at += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self):
        parts = []
        while (char := self.peek()) is not None and char not in "|)":
            if char == "$" and self.at == len(self.source) - 1:
                break
            parts.append(self.quantified(self.atom()))
        return ("seq", parts)

    def quantified(self, tree):
        char = self.peek()
        if char is None or char not in "*+?{":
            return tree
        if char == "{":
            low, high = self.braces()
        else:
            self.at += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        if self.peek() == "?":  # lazy: the same strings match
            self.at += 1
        if self.peek() is not None and self.peek() in "*+?{":
            self.fail("a quantifier after a quantifier")
        return ("repeat", tree, low, high)

    def braces(self) -> tuple[int, int | None]:
        close = self.source.find("}", self.at)
        body = self.source[self.at + 1: close] if close > 0 else ""
        low, comma, high = body.partition(",")
        if not low.isdigit() or (high and not high.isdigit()):
            self.fail("a brace that is not {n}, {n,} or {n,m}")
        self.at = close + 1
        low_n, high_n = int(low), (None if comma and not high else int(high) if high else int(low))
        if high_n is not None and high_n < low_n or max(low_n, high_n or 0) > MAX_REPEAT:
            self.fail(f"the repetition {{{body}}}")
        return low_n, high_n

    def atom(self):
        char = self.source[self.at]
        self.at += 1
        if char == "(":
            named = NAMED_GROUP.match(self.source, self.at)
            if self.source.startswith("?:", self.at):
                self.at += 2
            elif named is not None:  # a name changes nothing a grammar asks (whether a text matches)
                self.at = named.end()
            elif self.peek() == "?":
                self.fail("a lookaround or a flag")
            inner = self.alternation()
            if self.peek() != ")":
                self.fail("an unclosed group")
            self.at += 1
            return inner
        if char == "[":
            return ("chars", self.char_class())
        if char == ".":
            return ("chars", CharSet(LINE_BREAKS, negated=True))
        if char == "\\":
            return ("chars", self.escape(in_class=False))
        if char in "^$":
            self.fail(f"the anchor {char!r} inside the pattern")
        if char in "*+?{)":
            self.fail(f"{char!r} with nothing before it")
        return ("chars", CharSet(((ord(char), ord(char)),)))

    def escape(self, in_class: bool) -> CharSet:
        if self.at >= len(self.source):
            self.fail("a trailing backslash")
        char = self.source[self.at]
        self.at += 1
        if char in CLASS_ESCAPES:
            ranges, negated = CLASS_ESCAPES[char]
            return CharSet(ranges, negated)
        if char in CONTROL_ESCAPES:
            code = CONTROL_ESCAPES[char]
        elif char == "u" and len(self.source) >= self.at + 4 and all(
                c in "0123456789abcdefABCDEF" for c in self.source[self.at: self.at + 4]):
            code = int(self.source[self.at: self.at + 4], 16)
            self.at += 4
        elif char == "b" and in_class:
            code = 0x08
        elif char.isalnum():
            self.fail(f"the escape \\{char}")
        else:
            code = ord(char)
        return CharSet(((code, code),))

    def char_class(self) -> CharSet:
        negated = self.peek() == "^"
        self.at += negated
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            char = self.peek()
            if char is None:
                self.fail("an unclosed class")
            if char == "]" and not first:
                self.at += 1
                break
            first = False
            low = self.class_member()
            if isinstance(low, CharSet):
                if low.negated:
                    self.fail("a negated escape inside a class")
                ranges += low.ranges
                continue
            if self.peek() == "-" and self.source[self.at + 1: self.at + 2] not in ("]", ""):
                self.at += 1
                high = self.class_member()
                if isinstance(high, CharSet) or high < low:
                    self.fail("a bad range in a class")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        return CharSet(tuple(ranges), negated)

    def class_member(self) -> int | CharSet:
        char = self.source[self.at]
        self.at += 1
        if char != "\\":
            return ord(char)
        escaped = self.escape(in_class=True)
        if escaped.negated or len(escaped.ranges) != 1 or escaped.ranges[0][0] != escaped.ranges[0][1]:
            return escaped
        return escaped.ranges[0][0]
