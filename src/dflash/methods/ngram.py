"""`ngram`: prompt lookup. No model: the drafts are what followed the latest earlier occurrence of the sequence's tail.

This file is the whole method, and the example docs/METHODS.md walks through for adding one.
"""

from __future__ import annotations

from .base import Draft, Method, MethodOptions, Proposer

DEFAULT_BLOCK_SIZE = 8


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_draft: int = DEFAULT_BLOCK_SIZE - 1, max_ngram: int = 3, min_ngram: int = 1):
        self.max_draft, self.max_ngram, self.min_ngram = max_draft, max_ngram, min_ngram

    def propose(self, sequence: list[int], limit: int | None = None, keep_going=None) -> Draft:
        count = self.max_draft if limit is None else min(limit, self.max_draft)
        if count <= 0:
            return Draft([])
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            tail = sequence[-n:]
            # latest match first: recent text predicts the continuation best
            for start in range(len(sequence) - n - 1, -1, -1):
                if sequence[start: start + n] == tail:
                    follow = sequence[start + n: start + n + count]
                    if follow:
                        return Draft(follow)
        return Draft([])


def build(target, options: MethodOptions) -> tuple[NgramProposer, None]:
    return NgramProposer(max_draft=(options.block_size or DEFAULT_BLOCK_SIZE) - 1), None


METHOD = Method(name="ngram", summary="prompt lookup: copy what followed the latest match of the last 1-3 tokens",
                build_proposer=build, block_size_help="the number of copied drafts + 1")
