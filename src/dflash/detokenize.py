"""The text of a growing generation, decoding only its end.

Stop strings and streamed text both need the text of everything generated so far after every round. Decoding the
whole output each time costs O(n) a round and O(n^2) a generation: ~1 ms a round at 4,000 tokens with SmolLM2's
tokenizer, paid by every sequence of a batch, on the thread that runs the model (scripts/time_growing_text.py).
"""

from __future__ import annotations

import functools
import re
from typing import Callable

SETTLE_EVERY = 64  # tokens between moves of the settled point (each move decodes the whole text once)
MARGIN = 8  # tokens left unsettled behind the end: a character's bytes or a decoder's clean-up may span them
LOOK_BACK = 32  # tokens before MARGIN searched for a point that does not follow a byte token
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class GrowingText:
    """`decode(ids)` of a token list that grows between calls, at the cost of decoding its unsettled end.

    The text of the first tokens is kept (settled); a call decodes only the tokens after them, with the last settled
    token in front and its own text cut off again, so a decoder that joins tokens with spaces or strips the first
    token's leading space renders the boundary as it does inside the whole. The settled point moves every
    SETTLE_EVERY tokens, and only where the whole text equals the kept text plus the decoded end: a point inside a
    character (byte-level tokens), or one that a decoder's clean-up reaches across, is not taken. Ids that do not
    begin with the settled tokens (another branch, a shorter list) are decoded whole, so every call returns exactly
    what `decode(ids)` does.

    `fragile`: tokens the settled point may not follow. A byte-fallback decoder (Llama 2's, Gemma's) renders a run
    of byte tokens as a whole, and one byte that makes the run invalid UTF-8 turns every byte of it into U+FFFD, so
    a token that comes later could rewrite text before a point that follows a byte token (`byte_tokens`)."""

    def __init__(self, decode: Callable[[list[int]], str], fragile: frozenset[int] = frozenset()):
        self.decode, self.fragile = decode, fragile
        self.settled: list[int] = []
        self.settled_text = ""
        self.anchor_text = ""  # the last settled token's own text
        self.next_move = SETTLE_EVERY

    def __call__(self, ids: list[int]) -> str:
        if len(ids) >= self.next_move:
            return self._move(ids)
        return self._text(ids)

    def _text(self, ids: list[int]) -> str:
        point = len(self.settled)
        if point and len(ids) > point and ids[:point] == self.settled:
            return self.settled_text + self._after(ids, point, self.anchor_text)
        return self.decode(ids)

    def _after(self, ids: list[int], point: int, anchor_text: str) -> str:
        """The text ids[point:] add to the text of ids[:point]."""
        return self.decode(ids[point - 1:])[len(anchor_text):]

    def _move(self, ids: list[int]) -> str:
        whole = self.decode(ids)
        self.next_move = len(ids) + SETTLE_EVERY
        if self.settled and self._text(ids) != whole:  # a decoder that reaches back past MARGIN: start over
            self.settled, self.settled_text, self.anchor_text = [], "", ""
        point = len(ids) - MARGIN
        while ids[point - 1] in self.fragile:
            point -= 1
            if point <= max(len(self.settled), len(ids) - MARGIN - LOOK_BACK):
                return whole
        head, anchor_text = self._text(ids[:point]), self.decode(ids[point - 1: point])
        end = self.decode(ids[point - 1:])
        if end.startswith(anchor_text) and whole == head + end[len(anchor_text):]:
            self.settled, self.settled_text, self.anchor_text = ids[:point], head, anchor_text
        return whole


@functools.lru_cache(maxsize=8)
def byte_tokens(tokenizer) -> frozenset[int]:
    """The ids of a byte-fallback vocabulary's byte tokens ("<0x0A>"): GrowingText's `fragile` for its tokenizer.
    Read once per tokenizer (a 262K vocabulary takes a while)."""
    return frozenset(i for token, i in tokenizer.get_vocab().items() if BYTE_TOKEN.fullmatch(token))
