"""How much a lookup over the target's own regenerated corpus could add to prompt lookup, before building one.

Usage: .venv/bin/python scripts/corpus_lookup_estimate.py [LENGTHS]
(default LENGTHS = 8,5,3,2, the shipped table's context lengths; e.g. 3 for the first table; float32
SmolLM2-135M, 2 threads)

The committed corpus (corpus/smollm2-135m: 15,511 responses, 5M tokens) is the target's own greedy output on
GSM8K-train, Code Alpaca and ShareGPT prompts, so its phrasing is the target's. This builds a continuation table of
its responses with contexts of LENGTHS tokens (methods/continuations.py: the most frequent continuation, kept where
it was seen at least twice and is at least half of that context's continuations, from the longest context known),
generates each benchmark prompt greedily with `ar` (128 tokens), and at EVERY position of each output compares two
free drafts of up to 8 tokens with what the target generated: the table's chain of continuations, and prompt
lookup's (the last 3, 2 or 1 tokens found earlier in the sequence). Printed per dataset, per position: how often
each drafted, the drafts each got accepted, the better of the two (an oracle choice), the corpus's accepted drafts
where prompt lookup got none, and the accepted drafts of the two orders of trying them: the table only where prompt
lookup has no match, and the table before a 1-token match (`ngram`'s). Every position is a potential round start,
so these are not taus: they bound what a second free lookup could add.
"""

import collections
import sys
import time
from pathlib import Path

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.corpus import read_packed
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.continuations import CONTEXTS, ContinuationTable
from dflash.methods.ngram import WEAK_MATCH

DATASETS = (("gsm8k", 8), ("mt_bench", 6), ("humaneval", 6), ("math500", 6))
DRAFTS = 8


def lookup_draft(context: list[int]) -> tuple[list[int], int]:
    """Prompt lookup's drafts and the length of its match (0: none)."""
    for n in (3, 2, 1):
        pattern = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i: i + n] == pattern:
                return context[i + n: i + n + DRAFTS], n
    return [], 0


def accepted(draft: list[int], actual: list[int]) -> int:
    n = 0
    while n < min(len(draft), len(actual)) and draft[n] == actual[n]:
        n += 1
    return n


def main(argv: list[str]) -> int:
    lengths = tuple(int(n) for n in argv[0].split(",")) if argv else CONTEXTS
    torch.set_num_threads(2)
    started = time.time()
    target = load_target_cached("smollm2-135m", "float32")
    records = read_packed(Path("corpus/smollm2-135m"))
    table = ContinuationTable.build([r["input_ids"][r["loss_start"]:] for r in records], target.vocab_size, lengths)
    print(f"{len(table)} contexts of {lengths} tokens kept, {time.time() - started:.1f} s", file=sys.stderr)
    decoder = SpeculativeDecoder(target, build_proposer("ar", target)[0], adaptive=True)
    for dataset, limit in DATASETS:
        path, template = resolve_dataset(dataset)
        totals = collections.Counter()
        for prompt in read_prompts(path, template, limit):
            ids = target.encode_prompt(prompt.turns[0])
            full = list(ids) + decoder.generate(ids, GenerationConfig(max_new_tokens=128, ignore_eos=True)).tokens
            for pos in range(len(ids), len(full) - 1):
                context, actual = full[:pos], full[pos: pos + DRAFTS]
                corpus, (lookup, match) = table.draft(context, DRAFTS), lookup_draft(context)
                got_corpus, got_lookup = accepted(corpus, actual), accepted(lookup, actual)
                table_first = corpus and match <= WEAK_MATCH  # ngram's order: 3- and 2-token matches, table, 1-token
                totals.update({"positions": 1, "corpus drafts": bool(corpus), "corpus accepted": got_corpus,
                               "lookup drafts": bool(lookup), "lookup accepted": got_lookup,
                               "better of the two": max(got_corpus, got_lookup),
                               "corpus where lookup got none": got_corpus if got_lookup == 0 else 0,
                               "where lookup has no match": got_corpus if not lookup else got_lookup,
                               "before a 1-token match": got_corpus if table_first else got_lookup})
        n = totals.pop("positions")
        print(f"{dataset} ({n} positions): " + ", ".join(f"{k} {v / n:.3f}" for k, v in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
