"""`ngram`: prompt lookup. No model: the drafts are what followed the latest earlier occurrence of the sequence's tail.

This file is the whole method, and the example docs/METHODS.md walks through for adding one.
"""

from __future__ import annotations

from array import array

from .base import Draft, Method, MethodOptions, Proposer

DEFAULT_BLOCK_SIZE = 8


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_draft: int = DEFAULT_BLOCK_SIZE - 1, max_ngram: int = 3, min_ngram: int = 1):
        self.max_draft, self.max_ngram, self.min_ngram = max_draft, max_ngram, min_ngram

    def propose(self, sequence: list[int], limit: int | None = None, keep_going=None) -> Draft:
        count = self.max_draft if limit is None else min(limit, self.max_draft)
        if count <= 0 or len(sequence) < 2:
            return Draft([])
        # the search runs over the tokens as 4-byte words in C (bytes.rfind): a Python loop over a 1000-token
        # sequence without a match took 0.3 ms a round, a sizeable part of a 10 ms step
        words = array("i", sequence).tobytes()
        before_last = (len(sequence) - 1) * 4  # a match must end before the tail's last token: drafts follow it
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            start = latest_word_match(words, words[-4 * n:], before_last)
            if start >= 0:  # latest match first: recent text predicts the continuation best
                return Draft(sequence[start + n: start + n + count], label=n)  # a longer match is surer
        return Draft([])


def latest_word_match(words: bytes, tail: bytes, end: int) -> int:
    """The token index of the latest occurrence of `tail` in words[:end] that starts on a token (4-byte) boundary;
    -1 if none."""
    at = words.rfind(tail, 0, end)
    while at > 0 and at % 4:  # a match across token boundaries: look before it
        at = words.rfind(tail, 0, at + len(tail) - 1)
    return at // 4 if at >= 0 else -1


def build(target, options: MethodOptions) -> tuple[NgramProposer, None]:
    return NgramProposer(max_draft=(options.block_size or DEFAULT_BLOCK_SIZE) - 1), None


METHOD = Method(name="ngram", summary="prompt lookup: copy what followed the latest match of the last 1-3 tokens",
                build_proposer=build, block_size_help="the number of copied drafts + 1")
