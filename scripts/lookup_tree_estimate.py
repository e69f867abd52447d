"""How much a two-branch prompt-lookup tree could add, at the round starts of real decoding, before building one.

Usage: .venv/bin/python scripts/lookup_tree_estimate.py [DATASETS] [LIMIT]
(defaults: gsm8k,humaneval,mt_bench,math500 and 8 prompts each; bfloat16 SmolLM2-135M-Instruct, 128 new tokens,
2 threads)

Each prompt is decoded with `ar` (the target's greedy continuation) and with `ngram` verifying whole drafts (7 a
round, deterministic). At each of `ngram`'s rounds with a prompt match of 2+ tokens, the second-latest earlier
occurrence of the matched tail whose continuation starts with another token (a second branch) is scored against the
target's continuation too. Printed per dataset: the rounds, those with a second branch, and tau as decoded against
tau had each round also kept the better branch. An upper bound: the wider pass such a tree needs is not charged.
"""

import sys

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import load_target_cached
from dflash.methods import ngram
from dflash.methods.base import Proposer

DRAFTS = 7


def accepted(draft: list[int], actual: list[int]) -> int:
    n = 0
    while n < min(len(draft), len(actual)) and draft[n] == actual[n]:
        n += 1
    return n


def second_branch(sequence: list[int], n: int, first: list[int]) -> list[int] | None:
    """What followed the latest earlier occurrence of the last n tokens whose continuation starts unlike `first`."""
    tail = sequence[-n:]
    for start in range(len(sequence) - n - 1, -1, -1):
        if sequence[start: start + n] == tail:
            continuation = sequence[start + n: start + n + DRAFTS]
            if continuation and first and continuation[0] != first[0]:
                return continuation
    return None


def main(argv: list[str]) -> int:
    datasets = (argv[0] if argv else "gsm8k,humaneval,mt_bench,math500").split(",")
    limit = int(argv[1]) if len(argv) > 1 else 8
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "bfloat16")
    config = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    for name in datasets:
        path, template = resolve_dataset(name)
        rounds = branched = base = extra = 0
        for prompt in read_prompts(path, template, limit):
            ids = target.encode_prompt(prompt.turns[0])
            full = list(ids) + SpeculativeDecoder(target, Proposer()).generate(ids, config).tokens
            lookup = ngram.lookup_for(target, DRAFTS)
            propose, starts = lookup.propose, []

            def recorded(sequence, limit=None, keep_going=None, propose=propose, starts=starts):
                draft = propose(sequence, limit, keep_going)
                starts.append((len(sequence), draft))
                return draft

            lookup.propose = recorded
            SpeculativeDecoder(target, lookup, adaptive=False).generate(ids, config)
            for length, draft in starts:
                actual = full[length: length + DRAFTS]
                first = accepted(draft.tokens, actual)
                rounds, base = rounds + 1, base + first
                branch = second_branch(full[:length], draft.label, draft.tokens) if (draft.label or 0) >= 2 else None
                if branch is not None:
                    branched += 1
                    extra += max(0, accepted(branch, actual) - first)
        print(f"{name}: {rounds} rounds, a second branch at {branched}; tau {1 + base / rounds:.3f} -> "
              f"{1 + (base + extra) / rounds:.3f} at most", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
