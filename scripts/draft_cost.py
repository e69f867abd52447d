"""What drafting one DFlash block costs in each draft precision, against a target step (milliseconds).

Usage: .venv/bin/python scripts/draft_cost.py [THREADS] [PRECISIONS]   (default: 2 threads; float32,int8,int8-head)

Each round runs one target step (as a round does: its 540 MB evict the drafter's weights from the caches), then one
drafting pass of each precision after it, in turn, two new context rows per pass; medians of 30 rounds. "int8"
runs the drafter's layers as torch ops over int8 weights; "int8-head" and "float32" run them in one C call
(native.c's dflash_drafter_stack) over float32 weights, the first with an int8 LM head.
"""

import sys
import time

import torch

from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions


def main(argv: list[str]) -> int:
    torch.set_num_threads(int(argv[0]) if argv else 2)
    precisions = (argv[1] if len(argv) > 1 else "float32,int8,int8-head").split(",")
    target = load_target_cached("smollm2-135m", "float32")
    proposers = {p: build_proposer("dflash", target, MethodOptions(draft_dtype=p))[0] for p in precisions}
    prompt = target.encode_prompt("Janet's ducks lay 16 eggs per day. How much does she make every day?")
    layers = next(iter(proposers.values())).feature_layers
    features = target.forward(torch.tensor([prompt]), None, layers).features
    sequences = {}
    for name, proposer in proposers.items():
        proposer.start(prompt, features)
        sequences[name] = prompt + [5]
    cache = target.new_cache(capacity=512)
    target.forward(torch.arange(5, 205)[None], cache)
    times = {name: [] for name in ["step", *proposers]}
    for _ in range(31):
        for name, proposer in proposers.items():
            start = time.perf_counter()
            target.forward(torch.tensor([[5]]), cache)
            times["step"].append(time.perf_counter() - start)
            cache.truncate(200)
            start = time.perf_counter()
            proposer.propose(sequences[name])
            times[name].append(time.perf_counter() - start)
            proposer.commit([5, 7], features[:, -2:])
            sequences[name] += [5, 7]
    median = {name: 1000 * sorted(t[1:])[len(t) // 2] for name, t in times.items()}
    print(f"{torch.get_num_threads()} threads: a 1-token target step {median['step']:.1f} ms; drafting a block: "
          + ", ".join(f"{name} {median[name]:.1f} ms ({median[name] / median['step']:.2f} step)" for name in proposers))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
