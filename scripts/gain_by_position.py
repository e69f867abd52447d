"""Where does one drafter beat another? Accept lengths of a block at EVERY one of the first WINDOW response positions
of each held-out sequence (the tokens a WINDOW-token bench decodes), for two DFlash drafters, split into the
positions where greedy whole-block decoding starts its blocks (by each drafter's own decoding) and the others, and
by depth into the response (128 positions a line).

Usage: .venv/bin/python scripts/gain_by_position.py DRAFTER_A DRAFTER_B [DATA] [WINDOW] [EVAL_FRACTION] [DTYPE]
(defaults: corpus/smollm2-135m, 128, 0.006, bfloat16: target smollm2-135m in bfloat16 under autocast, as the drafters
trained; float32 runs without autocast, for a CPU without AVX512-BF16 or AMX, where torch's bfloat16 products crawl)
"""

import sys
from pathlib import Path

import numpy as np
import torch

from dflash import trainer
from dflash.loading import load_target_cached
from dflash.methods import registry
from dflash.methods.dflash.objective import accept_lengths, anchor_candidates, decode_rounds
from dflash.train_config import TrainConfig

BUCKET = 128  # response positions per line of the by-depth table


def accept_lengths_by_sequence(target, drafter: Path, data: str, window: int, fraction: float,
                                autocast: bool) -> list[list[int]]:
    recipe = registry.get("dflash").training
    model = recipe.load_model(drafter, target)
    config = TrainConfig(method="dflash", anchors_per_seq=window, eval_fraction=fraction)
    objective = recipe.objective(model, target, config.replace(recipe.shape_of(model)))
    usable = [e for e in trainer.load_examples(data) if objective.usable(e)]
    _, heldout = trainer.split_heldout(usable, fraction)
    objective.model.eval()
    lengths = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for example in heldout:
            ids = objective.sequence(example.input_ids)
            candidates = anchor_candidates(ids.shape[0], example.loss_start)
            positions = torch.arange(candidates.start, min(candidates.stop, candidates.start + window))
            if candidates.start == example.loss_start and len(positions):  # as eval_decode_tau takes them
                result = objective.blocks_result(ids, positions, example.loss_start)
                lengths.append(accept_lengths(result.correct).tolist())
    return lengths


def decode_starts(lengths: list[int]) -> set[int]:
    rounds = decode_rounds(lengths)
    return set(np.concatenate([[0], np.cumsum(rounds[:-1])]).astype(int).tolist())


def main() -> None:
    first, second = Path(sys.argv[1]), Path(sys.argv[2])
    data = sys.argv[3] if len(sys.argv) > 3 else "corpus/smollm2-135m"
    window = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    fraction = float(sys.argv[5]) if len(sys.argv) > 5 else 0.006
    dtype = sys.argv[6] if len(sys.argv) > 6 else "bfloat16"
    target = load_target_cached("smollm2-135m", dtype)
    runs = {name: accept_lengths_by_sequence(target, path, data, window, fraction, dtype == "bfloat16")
            for name, path in (("A", first), ("B", second))}
    for starts_of in ("A", "B"):
        split = {"starts": ([], []), "other": ([], [])}
        for a, b, own in zip(runs["A"], runs["B"], runs[starts_of]):
            starts = decode_starts(own)
            for i, (x, y) in enumerate(zip(a, b)):
                kind = split["starts" if i in starts else "other"]
                kind[0].append(x)
                kind[1].append(y)
        print(f"decode starts of {starts_of}: " + " | ".join(
            f"{kind} ({len(a)} positions): A {np.mean(a):.3f}, B {np.mean(b):.3f}" for kind, (a, b) in split.items()))
    for start in range(0, window, BUCKET):  # by depth into the response: where each drafter is strong
        a = [x for seq in runs["A"] for x in seq[start: start + BUCKET]]
        b = [x for seq in runs["B"] for x in seq[start: start + BUCKET]]
        if a:
            print(f"response positions {start}-{start + BUCKET - 1} ({len(a)}): A {np.mean(a):.3f}, B {np.mean(b):.3f}")
    for name, path in (("A", first), ("B", second)):
        every = [x for seq in runs[name] for x in seq]
        rounds = [r for seq in runs[name] for r in decode_rounds(seq)]
        print(f"{name} {path}: every position {np.mean(every):.3f}, decode tau {np.mean(rounds):.3f}")


if __name__ == "__main__":
    main()
