"""A whole output held to a regular expression, or to one of a list of strings (vLLM's structured outputs `regex`
and `choice`).

The expression is the pattern subset of patterns.py (literals, classes, groups, alternation, quantifiers), matched
against the whole output as Python's `re.fullmatch` would (a `^` or `$` at its ends changes nothing). Its automaton
reads the output's characters from their UTF-8 bytes; structured.py makes the masks of its states as it does a JSON
grammar's (JsonVocabulary walks every token from a state; a state the pattern leaves one byte allows forces it, so a
choice's rest is drafted free once its first bytes decide it). After a reasoning model's thinking too, as a JSON
grammar (grammar.ByteGrammar: the thought is free text up to `</think>`, the expression holds what follows).
"""

from __future__ import annotations

import functools
import itertools

import torch

from .errors import UserError
from .grammar import THINK_TAGS, THINKING, ByteGrammar, utf8_lead
from .patterns import compile_pattern

PATTERN = 100  # the mode of a state (a JSON grammar's modes are below it)
SPECIAL = frozenset("\\.[](){}*+?|^$")  # what a choice's text escapes
MAX_CHOICES = 1000
GRAMMARS = itertools.count()
MAX_MOVES = 1_000_000  # moves kept per grammar before they are found again
MAX_TABLE_STATES = 4096  # states an ASCII table may hold (ascii_table)


class PatternGrammar(ByteGrammar):
    """The automaton of one expression over a whole output. A state is (PATTERN, n) between characters, n the
    number of the pattern's state set; inside a multi-byte character (PATTERN, n, (bytes to come, the next byte's
    lowest, highest, its code so far)). The moves of the states between characters are kept as they are found, so
    the walks over a vocabulary (structured.py) mostly look a byte up; the few inside a character are not numbered
    (their codes would be many). The interface is JsonGrammar's (structured.py reads either)."""

    text_otherwise, frame, thinking = False, None, None
    kind = "regex"
    table_states = MAX_TABLE_STATES

    def __init__(self, expression: str, thinking: str | None = None):
        self.expression, self.thinking = expression, thinking
        self.pattern = self.automaton(expression)
        # masks are kept by key and state (structured.py), and states are numbered per grammar: one key each
        self.key = f"{self.kind}:{next(GRAMMARS)}:{thinking}:{expression}"
        self.parts: list[frozenset] = []  # a state's number -> the pattern's states
        self.numbers: dict[frozenset, int] = {}
        self.moves: dict[tuple[int, int], tuple | None] = {}  # (a state's number, a byte) -> the state after
        self.ascii_rows: dict[int, list[int]] = {}  # a state's number -> its row of ascii_table
        self.table: torch.Tensor | None = None
        self.start = self._state(self.pattern.start)
        self.initial = self.first_state()

    @staticmethod
    def automaton(expression: str):
        """What reads the output's characters: patterns.Pattern's interface (start, step, can_take, accepts)."""
        return compile_pattern(f"^(?:{unanchored(expression)})$")

    def thinking_first(self, thinking: str | None) -> "PatternGrammar":
        """This expression after a reasoning model's thinking (ByteGrammar; None: itself)."""
        return self if thinking is None else shared_grammar(type(self), self.expression, thinking)

    def feed(self, state: tuple, byte: int) -> tuple | None:
        """The state after one more byte, or None where no match continues that way."""
        if state[0] != PATTERN:
            return self.feed_thought(*state[:3], byte)
        if len(state) == 3:
            return self._move(state[1], state[2], byte)
        key = (state[1], byte)
        if key in self.moves:
            return self.moves[key]
        following = self._move(state[1], (), byte)
        if len(self.moves) > MAX_MOVES:
            self.moves.clear()
        self.moves[key] = following
        return following

    def _move(self, number: int, reading: tuple, byte: int) -> tuple | None:
        states = self.state_set(number)
        if not reading:
            if byte < 0x80:
                return self._character(states, byte)
            lead = utf8_lead(byte)
            if lead is None:
                return None
            left, low, high = lead
            reading = (left, low, high, byte & (0x7F >> (left + 1)))
        else:
            left, low, high, code = reading
            if not low <= byte <= high:
                return None
            left, code = left - 1, code << 6 | byte & 0x3F
            if left == 0:
                return self._character(states, code)
            reading = (left, 0x80, 0xBF, code)
        # a character begun: taken only where some character it may still become goes on towards a match
        left, low, high, code = reading
        shift = 6 * (left - 1)
        lowest, highest = (code << 6 | low & 0x3F) << shift, ((code << 6 | high & 0x3F) + 1 << shift) - 1
        return (PATTERN, number, reading) if self.pattern.can_take(states, lowest, highest) else None

    def _character(self, states: frozenset, code: int) -> tuple | None:
        following = self.pattern.step(states, code)
        return self._state(following) if following else None

    def state_set(self, number: int) -> frozenset:
        """The automaton's states behind a state's number."""
        return self.parts[number]

    def _state(self, states: frozenset) -> tuple:
        number = self.numbers.get(states)
        if number is None:
            number = self.numbers[states] = len(self.parts)
            self.parts.append(states)
        return (PATTERN, number)

    def ascii_table(self, state: tuple) -> tuple[torch.Tensor, int] | None:
        """The moves of every state that ASCII bytes reach from `state`, as a table [states + 1, 128] of rows: row
        n + 1 is state n's, each column the row after that byte (row 0: refused, and it stays so). (the table,
        `state`'s row); None where more than `table_states` states are reached (a vocabulary then walks its tokens,
        structured.py)."""
        if state[0] != PATTERN or len(state) == 3:
            return None
        todo, grew = [state[1]], False
        while todo:
            number = todo.pop()
            if number in self.ascii_rows:
                continue
            if len(self.ascii_rows) >= self.table_states:
                return None
            row = []
            for byte in range(0x80):
                following = self.feed((PATTERN, number), byte)
                row.append(0 if following is None else following[1] + 1)
                if following is not None and following[1] not in self.ascii_rows:
                    todo.append(following[1])
            self.ascii_rows[number], grew = row, True
        if grew or self.table is None:
            table = torch.zeros(len(self.parts) + 1, 0x80, dtype=torch.long)
            for number, row in self.ascii_rows.items():
                table[number + 1] = torch.tensor(row)
            self.table = table
        return self.table, state[1] + 1

    def may_end(self, state: tuple) -> bool:
        if state[0] != PATTERN:
            return self.thought_may_end(state)
        return len(state) == 2 and self.pattern.accepts(self.state_set(state[1]))

    def finished(self, state: tuple) -> bool:
        """Whether the output is a match that no further character keeps one."""
        return state[0] == PATTERN and self.may_end(state) and \
            not self.pattern.can_take(self.state_set(state[1]), 0, 0x10FFFF)

    def after_special(self, state: tuple) -> tuple | None:
        # a special token has no characters to match: text only in a thought
        return self.thought_after_special(state) if state[0] != PATTERN else None

    def free_text_tag(self, state: tuple) -> bytes | None:
        return THINK_TAGS[1] if state[0] == THINKING else None

    def delegate(self, state: tuple) -> tuple[tuple | None, bytes] | None:
        return self.thought_delegate(state)


@functools.lru_cache(maxsize=64)
def shared_grammar(kind: type, expression: str, thinking: str | None = None) -> PatternGrammar:
    """The grammar of `expression` (after a thinking, ByteGrammar), one each while it is in use: its states, moves
    and masks are shared by the requests that send it."""
    return kind(expression, thinking)


def pattern_grammar(expression: str, thinking: str | None = None) -> PatternGrammar:
    return shared_grammar(PatternGrammar, expression, thinking)


def unanchored(expression: str) -> str:
    """The expression without a `^` before it or an unescaped `$` after it (the whole output matches anyway)."""
    if expression.startswith("^"):
        expression = expression[1:]
    backslashes = len(expression[:-1]) - len(expression[:-1].rstrip("\\"))
    if expression.endswith("$") and backslashes % 2 == 0:
        expression = expression[:-1]
    return expression


def choice_expression(choices) -> str:
    """The expression that matches exactly one of `choices` (strings, each written as it is)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise UserError("choice must be a list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise UserError(f"choice takes at most {MAX_CHOICES} strings, got {len(choices)}")
    return "|".join("".join("\\" + c if c in SPECIAL else c for c in choice) for choice in choices)


def pattern_format(regex: str | None, choice: list | None) -> tuple[str, dict] | None:
    """(response_format, json_schema) of GenerationConfig for a regex or a choice (None: neither), checked here:
    an expression that cannot be enforced is refused before anything is generated."""
    if regex is not None and choice is not None:
        raise UserError("send a regex or a choice, not both")
    if regex is None and choice is None:
        return None
    if regex is not None and not isinstance(regex, str):
        raise UserError(f"regex must be a string, got {type(regex).__name__}")
    expression = regex if regex is not None else choice_expression(choice)
    PatternGrammar(expression)
    return "regex", {"regex": expression}

