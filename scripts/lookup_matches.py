"""How prompt lookup's drafts fare by the length of the match they copied, in `dflash+ngram` generations.

Usage: .venv/bin/python scripts/lookup_matches.py [float32|bfloat16] [DATASET] [LIMIT]   (defaults: bfloat16,
humaneval, 6; 128 new tokens, greedy, 2 threads)

Prints, per match length, the rounds that verified the lookup's drafts, the drafts verified and accepted: the
figures behind calibrating lookup drafts by their label (control.py, Calibration).
"""

import collections
import sys

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.control import DraftController
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "bfloat16"
    dataset = argv[1] if len(argv) > 1 else "humaneval"
    limit = int(argv[2]) if len(argv) > 2 else 6
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    target.measure = True  # the engine times its passes as `dflash generate` does
    proposer, _ = build_proposer("dflash+ngram", target, MethodOptions(draft_dtype="auto"))
    by_length = collections.defaultdict(lambda: [0, 0, 0])  # match length -> rounds, verified, accepted
    record = DraftController.record

    def counting(self, drafted, confidences, verified, accepted, *args, lookup=False, label=None, **kwargs):
        if lookup:
            counts = by_length[label]
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + verified, counts[2] + accepted
        return record(self, drafted, confidences, verified, accepted, *args, lookup=lookup, label=label, **kwargs)

    DraftController.record = counting
    decoder = SpeculativeDecoder(target, proposer)
    path, template = resolve_dataset(dataset)
    for prompt in read_prompts(path, template, limit):
        ids = target.encode_messages([{"role": "user", "content": prompt.turns[0]}])
        decoder.generate(ids, GenerationConfig(max_new_tokens=128))
    print(f"dflash+ngram, {dtype}, {dataset} ({limit} prompts): lookup rounds by match length")
    for length in sorted(by_length):
        rounds, verified, accepted = by_length[length]
        print(f"match of {length}: {rounds} rounds, {verified} drafts verified, {accepted} accepted "
              f"({accepted / max(1, verified):.0%} of verified, {accepted / max(1, rounds):.2f} a round)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
