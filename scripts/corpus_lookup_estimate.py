"""How much a lookup over the target's own regenerated corpus could add to prompt lookup, before building one.

Usage: .venv/bin/python scripts/corpus_lookup_estimate.py [L]   (default L = 3; float32 SmolLM2-135M, 2 threads)

The committed corpus (corpus/smollm2-135m: 15,511 responses, 5M tokens) is the target's own greedy output on
GSM8K-train, Code Alpaca and ShareGPT prompts, so its phrasing is the target's. This builds an L-token -> next-token
table of its responses (the most frequent continuation, kept where it was seen at least twice and is at least half
of that context's continuations), generates each benchmark prompt greedily with `ar` (128 tokens), and at EVERY
position of each output compares two free drafts of up to 8 tokens with what the target generated: the table's
chain of continuations, and prompt lookup's (the last 3, 2 or 1 tokens found earlier in the sequence). Printed per
dataset, per position: how often each drafted, the drafts each got accepted, the better of the two (an oracle
choice), and the corpus's accepted drafts where prompt lookup got none. Every position is a potential round start,
so these are not taus: they bound what a second free lookup could add.
"""

import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.corpus import read_packed
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached

DATASETS = (("gsm8k", 8), ("mt_bench", 6), ("humaneval", 6), ("math500", 6))
DRAFTS = 8


def continuation_table(sequences: list[np.ndarray], length: int, min_count: int = 2, min_share: float = 0.5) -> dict:
    """context key (L tokens of 16 bits) -> its most frequent next token, where that one is frequent enough."""
    keys, nexts = [], []
    for s in sequences:
        if len(s) <= length:
            continue
        key = np.zeros(len(s) - length, dtype=np.int64)
        for j in range(length):  # 4 tokens fill all 64 bits: the wrap keeps keys distinct
            key = key * 65536 + s[j: len(s) - length + j]
        keys.append(key)
        nexts.append(s[length:])
    keys, nexts = np.concatenate(keys), np.concatenate(nexts)
    order = np.lexsort((nexts, keys))
    keys, nexts = keys[order], nexts[order]
    pair_starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])])
    counts = np.diff(np.r_[pair_starts, len(keys)])
    pair_keys, pair_nexts = keys[pair_starts], nexts[pair_starts]
    key_starts = np.flatnonzero(np.r_[True, pair_keys[1:] != pair_keys[:-1]])
    table = {}
    for a, b in zip(key_starts, np.r_[key_starts[1:], len(pair_keys)]):
        i = a + int(np.argmax(counts[a:b]))
        if counts[i] >= min_count and counts[i] >= min_share * counts[a:b].sum():
            table[int(pair_keys[a])] = int(pair_nexts[i])
    return table


def corpus_draft(table: dict, context: list[int], length: int) -> list[int]:
    tokens, draft = list(context[-length:]), []
    while len(draft) < DRAFTS:
        key = 0
        for t in tokens[-length:]:
            key = key * 65536 + t
        key = (key + 2**63) % 2**64 - 2**63  # as numpy's int64 wrapped it
        if key not in table:
            break
        draft.append(table[key])
        tokens.append(table[key])
    return draft


def lookup_draft(context: list[int]) -> list[int]:
    for n in (3, 2, 1):
        pattern = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i: i + n] == pattern:
                return context[i + n: i + n + DRAFTS]
    return []


def accepted(draft: list[int], actual: list[int]) -> int:
    n = 0
    while n < min(len(draft), len(actual)) and draft[n] == actual[n]:
        n += 1
    return n


def main(argv: list[str]) -> int:
    length = int(argv[0]) if argv else 3
    torch.set_num_threads(2)
    started = time.time()
    records = read_packed(Path("corpus/smollm2-135m"))
    table = continuation_table([np.array(r["input_ids"][r["loss_start"]:], dtype=np.int64) for r in records], length)
    print(f"{len(table)} contexts of {length} tokens kept, {time.time() - started:.1f} s", file=sys.stderr)
    target = load_target_cached("smollm2-135m", "float32")
    decoder = SpeculativeDecoder(target, build_proposer("ar", target)[0], adaptive=True)
    for dataset, limit in DATASETS:
        path, template = resolve_dataset(dataset)
        totals = collections.Counter()
        for prompt in read_prompts(path, template, limit):
            ids = target.encode_prompt(prompt.turns[0])
            full = list(ids) + decoder.generate(ids, GenerationConfig(max_new_tokens=128, ignore_eos=True)).tokens
            for pos in range(len(ids), len(full) - 1):
                context, actual = full[:pos], full[pos: pos + DRAFTS]
                corpus, lookup = corpus_draft(table, context, length), lookup_draft(context)
                got_corpus, got_lookup = accepted(corpus, actual), accepted(lookup, actual)
                totals.update({"positions": 1, "corpus drafts": bool(corpus), "corpus accepted": got_corpus,
                               "lookup drafts": bool(lookup), "lookup accepted": got_lookup,
                               "better of the two": max(got_corpus, got_lookup),
                               "corpus where lookup got none": got_corpus if got_lookup == 0 else 0})
        n = totals.pop("positions")
        print(f"{dataset} ({n} positions): " + ", ".join(f"{k} {v / n:.3f}" for k, v in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
