"""`ngram`: prompt lookup. No model: the drafts are what followed the latest earlier occurrence of the sequence's tail,
or, where that tail is a single token or has no earlier occurrence, the target's own frequent continuation of its
last tokens (a table shipped for the registry's targets, continuations.py; DFLASH_CONTINUATIONS=0 leaves it out).

This file is the whole method, and the example docs/METHODS.md walks through for adding one.
"""

from __future__ import annotations

from array import array

from .base import TABLE_LABEL, Draft, Method, MethodOptions, Proposer
from .continuations import ContinuationTable, table_for

DEFAULT_BLOCK_SIZE = 8
# Prompt matches this short come after the table: over SmolLM2's answers to GSM8K, MT-Bench and HumanEval a 1-token
# match's first draft was right 14-24% of the time, the table's 50-90% (scripts/corpus_lookup_estimate.py).
WEAK_MATCH = 1
# The longest tail a match is looked for with (the longest first): its length labels the drafts, which the
# controller calibrates apart. Over SmolLM2's greedy answers a 5-token match's 7 drafts were accepted 2.9-5.1 deep
# where an exactly-3-token one's were 1.8-2.3 (all under one label before, as "3 or more"); on 8 bfloat16 prompts
# each, `ngram` took 0.90x the time per token on GSM8K and HumanEval and 0.79x on MT-Bench, `dflash+ngram` 0.99x-1.01x
# (`scripts/ab_switch.py long-matches D 8 ngram,dflash+ngram 128 --dtype bfloat16`, LONG_MATCH=5; docs/RESULTS.md).
MAX_MATCH = 5


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_draft: int = DEFAULT_BLOCK_SIZE - 1, max_ngram: int | None = None, min_ngram: int = 1,
                 table: ContinuationTable | None = None):
        self.max_draft, self.min_ngram = max_draft, min_ngram
        self.max_ngram = MAX_MATCH if max_ngram is None else max_ngram
        self.table = table

    def propose(self, sequence: list[int], limit: int | None = None, keep_going=None) -> Draft:
        count = self.max_draft if limit is None else min(limit, self.max_draft)
        if count <= 0 or len(sequence) < 2:
            return Draft([])
        # the search runs over the tokens as 4-byte words in C (bytes.rfind): a Python loop over a 1000-token
        # sequence without a match took 0.3 ms a round, a sizeable part of a 10 ms step
        words = array("i", sequence).tobytes()
        before_last = (len(sequence) - 1) * 4  # a match must end before the tail's last token: drafts follow it
        table_tried = self.table is None
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            if n <= WEAK_MATCH and not table_tried:  # the target's own continuation before a weak match
                table_tried = True
                drafts = self.table.draft(sequence, count)
                if drafts:
                    return Draft(drafts, label=TABLE_LABEL)
            start = latest_word_match(words, words[-4 * n:], before_last)
            if start >= 0:  # latest match first: recent text predicts the continuation best
                return Draft(sequence[start + n: start + n + count], label=n)  # a longer match is surer
        return Draft([] if table_tried else self.table.draft(sequence, count), label=TABLE_LABEL)


def latest_word_match(words: bytes, tail: bytes, end: int) -> int:
    """The token index of the latest occurrence of `tail` in words[:end] that starts on a token (4-byte) boundary;
    -1 if none."""
    at = words.rfind(tail, 0, end)
    while at > 0 and at % 4:  # a match across token boundaries: look before it
        at = words.rfind(tail, 0, at + len(tail) - 1)
    return at // 4 if at >= 0 else -1


def lookup_for(target, max_draft: int, options: MethodOptions | None = None) -> NgramProposer:
    """Prompt lookup for `target`, with the continuation table `options.continuations` names (a folder, "none";
    default: the one shipped for the target, where there is one) and the match lengths it says (vLLM's
    prompt_lookup_max and _min). Which table, in its `report`: bench JSON and `generate --json` say whether an
    `ngram` figure had a table."""
    options = options or MethodOptions()
    lookup = NgramProposer(max_draft=max_draft, max_ngram=options.prompt_lookup_max,
                           min_ngram=options.prompt_lookup_min or 1, table=table_for(target, options.continuations))
    lookup.report = {"continuation_table": lookup.table.source if lookup.table is not None else "none"}
    return lookup


def build(target, options: MethodOptions) -> tuple[NgramProposer, None]:
    return lookup_for(target, (options.block_size or DEFAULT_BLOCK_SIZE) - 1, options), None


METHOD = Method(name="ngram", summary="prompt lookup: copy what followed the latest match of the last 5 to 2 "
                "tokens, else the target's own frequent continuation, else what followed the last token",
                build_proposer=build, block_size_help="the number of copied drafts + 1")
