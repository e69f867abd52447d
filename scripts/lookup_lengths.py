"""Prompt lookup's drafts at every position of greedy answers, by the length of the match they came from, for
matches sought up to 3, 5 and 8 tokens: how deep each label's drafts are accepted (7 drafts at most). What
`ngram.MAX_MATCH` rests on.

Usage: .venv/bin/python scripts/lookup_lengths.py [DATASETS] [PROMPTS]   (defaults: gsm8k,mt_bench,humaneval 8;
SmolLM2-135M-Instruct in bfloat16, 128 new tokens, the shipped continuation table)
"""

import collections
import sys

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.continuations import table_for
from dflash.methods.ngram import NgramProposer


def accepted(draft: list[int], answer: list[int], at: int) -> int:
    """How many of `draft` match `answer` from index `at` on."""
    count = 0
    while count < len(draft) and at + count < len(answer) and answer[at + count] == draft[count]:
        count += 1
    return count


def main(argv: list[str]) -> int:
    datasets = (argv[0] if argv else "gsm8k,mt_bench,humaneval").split(",")
    limit = int(argv[1]) if len(argv) > 1 else 8
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "bfloat16")
    plain = SpeculativeDecoder(target, build_proposer("ar", target)[0])
    table = table_for(target, None)
    lookups = {n: NgramProposer(max_draft=7, max_ngram=n, table=table) for n in (3, 5, 8)}
    for dataset in datasets:
        path, template = resolve_dataset(dataset)
        prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, limit)]
        by_label = {n: collections.defaultdict(lambda: [0, 0]) for n in lookups}  # label -> [drafts made, accepted]
        for ids in prompts:
            answer = ids + plain.generate(ids, GenerationConfig(max_new_tokens=128)).tokens
            for end in range(len(ids), len(answer) - 1):
                for n, lookup in lookups.items():
                    draft = lookup.propose(answer[:end + 1])
                    depth = accepted(draft.tokens, answer, end + 1)
                    for label in ("none" if not draft.tokens else draft.label, "all"):
                        by_label[n][label][0] += 1
                        by_label[n][label][1] += depth
        for n, counts in by_label.items():
            rows = ", ".join(f"{label}: {made} x {total / made:.2f}"
                             for label, (made, total) in sorted(counts.items(), key=lambda kv: str(kv[0])))
            print(f"{dataset}, matches up to {n} tokens (label: positions x mean accepted): {rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
