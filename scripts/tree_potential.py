"""What verifying the drafter's block AND prompt lookup's draft in one pass (a two-branch tree) could bring, before
building it: `dflash:whole` generates (bfloat16), and at each round the drafter's block and the lookup's draft for
the same sequence (15 drafts each) are scored against the greedy answer. Prints, per round, the mean accepted
depth of the drafter's, of the lookup's, and of the better of the two.

Usage: .venv/bin/python scripts/tree_potential.py [DATASET] [PROMPTS]   (defaults: gsm8k 6)
"""

import sys

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from lookup_lengths import accepted


def main(argv: list[str]) -> int:
    dataset = argv[0] if argv else "gsm8k"
    limit = int(argv[1]) if len(argv) > 1 else 6
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "bfloat16")
    path, template = resolve_dataset(dataset)
    prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, limit)]
    config = GenerationConfig(max_new_tokens=128)
    plain = SpeculativeDecoder(target, build_proposer("ar", target)[0])
    proposer = build_proposer("dflash+ngram", target)[0]
    rounds: list[tuple[int, list[int], list[int]]] = []  # (the bonus's index + 1, drafter's block, lookup's draft)
    drafter_propose = proposer.propose

    def both(sequence, limit=None, keep_going=None):
        block = drafter_propose(sequence, limit, keep_going)
        rounds.append((len(sequence), list(block.tokens), list(proposer.lookup.propose(sequence, 15).tokens)))
        return block

    proposer.propose = both
    whole = SpeculativeDecoder(target, proposer, adaptive=False)
    totals = [0, 0, 0, 0]  # rounds, drafter, lookup, the better
    for ids in prompts:
        answer = ids + plain.generate(ids, config).tokens
        rounds.clear()
        assert ids + whole.generate(ids, config).tokens == answer
        for at, block, draft in rounds:
            d, lk = accepted(block, answer, at), accepted(draft, answer, at)
            for i, v in enumerate((1, d, lk, max(d, lk))):
                totals[i] += v
    n = totals[0]
    print(f"{dataset}, {n} rounds: accepted drafts a round: drafter {totals[1] / n:.2f}, lookup {totals[2] / n:.2f}, "
          f"the better of the two {totals[3] / n:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
