"""Seconds per training step at several sequences per pass: the same 8 sequences per step, forward and backward,
run as 8 passes of one, 2 of four, 1 of eight (`--seqs-per-pass`), interleaved.

Usage: .venv/bin/python scripts/time_pass_sizes.py [THREADS] [SIZES] [ANCHORS] [DEVICE] [ROUNDS] [DTYPE]
       (defaults: 2 threads, 1,4,8, 128 anchors, cpu, 3 rounds, float32; on a GPU: 0 512 cuda; DTYPE bfloat16 on a
       CPU: a bfloat16 target and bf16 autocast, as `dflash train --dtype bfloat16` runs there)

The shipped DFlash drafter (trainable, float32) on the committed corpus's first sequences, a new group of 8 for each
round; on CUDA under bf16 autocast like `dflash train`. The trainer chooses by the same measure at its first step on
a GPU (`Trainer.timed_per_pass`); this script shows the whole comparison.
"""

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from dflash import trainer
from dflash.loading import load_target_cached
from dflash.methods.dflash.objective import DFlashTraining
from dflash.train_config import TrainConfig


def main(argv: list[str]) -> int:
    threads = int(argv[0]) if argv else 2
    if threads:
        torch.set_num_threads(threads)
    sizes = [int(x) for x in (argv[1] if len(argv) > 1 else "1,4,8").split(",")]
    anchors = int(argv[2]) if len(argv) > 2 else 128
    device = argv[3] if len(argv) > 3 else "cpu"
    rounds = int(argv[4]) if len(argv) > 4 else 3
    cuda = device.startswith("cuda")
    dt = argv[5] if len(argv) > 5 else "float32"
    target = load_target_cached("smollm2-135m", "bfloat16" if cuda else dt, device=device)
    recipe = DFlashTraining()
    drafter = recipe.load_model(Path("src/dflash/drafters/smollm2-135m-dflash"), target).train()
    objective = recipe.objective(drafter, target, TrainConfig(anchors_per_seq=anchors))
    examples = [e for e in trainer.load_examples("corpus/smollm2-135m")[: 8 * (rounds + 1)] if objective.usable(e)]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                else torch.autocast("cpu", dtype=torch.bfloat16) if dt == "bfloat16" else nullcontext())
    seconds = {size: [] for size in sizes}
    for r in range(rounds + 1):  # round 0 warms up
        group = sorted(examples[8 * r: 8 * r + 8], key=lambda e: len(e.input_ids))
        for size in sizes:
            drafter.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            for s in range(0, len(group), size):
                part, rngs = group[s: s + size], [np.random.default_rng(i) for i in range(size)]
                with autocast:
                    results = objective.losses(part, rngs[: len(part)])
                (sum(loss for loss, _ in results) / len(group)).backward()
            if cuda:
                torch.cuda.synchronize()
            if r:
                seconds[size].append(time.perf_counter() - started)
    print(f"{device}, {threads or 'default'} threads, {anchors} anchors: seconds per step of 8 sequences, "
          f"{rounds} rounds (lengths {[len(e.input_ids) for e in examples[8:8 * (rounds + 1)]]})")
    for size in sizes:
        print(f"  {size} per pass: median {np.median(seconds[size]):.2f} s  ({', '.join(f'{x:.2f}' for x in seconds[size])})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
