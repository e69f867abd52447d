"""Methods side by side on one batch of a dataset's prompts through the engine (continuous batching, all rows at
once): seconds for the whole batch, its time relative to the first method, tau, and the widths of the decode
passes. Methods run interleaved, in alternating order, and their outputs must be identical.

Usage: .venv/bin/python scripts/batch_methods.py [DATASET] [ROWS] [NEW_TOKENS] [DTYPE] [METHODS] [REPEATS]
(defaults: gsm8k 8 128 float32 ar,ngram,dflash+ngram 2; SmolLM2-135M-Instruct, greedy, 2 threads; a first round
warms up and is not counted)
"""

import collections
import statistics
import sys
import time

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import Engine, GenerationConfig
from dflash.loading import build_proposer, load_target_cached


def run_batch(target, proposer, prompts, config, adaptive: bool = True):
    """(seconds, tau, widths of the decode passes, each row's tokens) of one batch through a fresh engine."""
    engine = Engine(target, proposer, max_batch=len(prompts), adaptive=adaptive)
    sequences = [engine.submit(ids, config) for ids in prompts]
    widths, forward = collections.Counter(), target.forward

    def noted(ids, *args, **kwargs):
        if ids.shape[0] > 1:  # a decode pass of the batch (prompts are read one row at a time)
            widths[ids.shape[1]] += 1
        return forward(ids, *args, **kwargs)

    target.forward = noted
    try:
        start = time.perf_counter()
        engine.run()
        seconds = time.perf_counter() - start
    finally:
        target.forward = forward
    tokens = sum(len(seq.result.tokens) for seq in sequences)
    rounds = sum(seq.result.stats.num_rounds for seq in sequences)
    return seconds, tokens / max(1, rounds), widths, [seq.result.tokens for seq in sequences]


def main(argv: list[str]) -> int:
    dataset = argv[0] if argv else "gsm8k"
    rows = int(argv[1]) if len(argv) > 1 else 8
    new_tokens = int(argv[2]) if len(argv) > 2 else 128
    dtype = argv[3] if len(argv) > 3 else "float32"
    methods = (argv[4] if len(argv) > 4 else "ar,ngram,dflash+ngram").split(",")
    repeats = int(argv[5]) if len(argv) > 5 else 2
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    path, template = resolve_dataset(dataset)
    prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, rows)]
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    proposers = {m: build_proposer(m, target)[0] for m in methods}
    times, taus, reference = collections.defaultdict(list), collections.defaultdict(list), None
    for repeat in range(repeats + 1):  # the first round warms up
        for method in methods if repeat % 2 == 0 else methods[::-1]:
            seconds, tau, widths, outputs = run_batch(target, proposers[method], prompts, config)
            reference = reference or outputs
            assert outputs == reference, f"{method}: a row's output differs from {methods[0]}'s"
            print(f"{'warm-up' if repeat == 0 else f'run {repeat}':8s} {method:14s} {seconds:6.2f} s  tau {tau:.2f}  "
                  f"passes by width {dict(sorted(widths.items()))}", flush=True)
            if repeat:
                times[method].append(seconds)
                taus[method].append(tau)
    base = statistics.median(times[methods[0]])
    print(f"\n{dataset}, {len(prompts)} rows x {new_tokens} new tokens, {dtype}, medians of {repeats}, outputs identical:")
    for method in methods:
        seconds = statistics.median(times[method])
        print(f"{method:14s} {seconds:6.2f} s  {seconds / base:.3f}x {methods[0]}'s time  "
              f"tau {statistics.median(taus[method]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
