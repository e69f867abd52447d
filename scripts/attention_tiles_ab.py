"""Attention through AMX tiles on and off (`native.set_attention_tiles`), pass by pass in one process.

Usage: .venv/bin/python scripts/attention_tiles_ab.py [CONTEXT] [WIDTHS] [PAIRS]
(defaults: 200 cached positions, widths 1,16, 60 pairs). SmolLM2-135M-Instruct in bfloat16, 2 threads, a CPU with
AMX (elsewhere the switch changes nothing). Each pair times one pass of WIDTH tokens after CONTEXT positions with
tiles on and one with them off, in alternating order, on the same cache (rolled back to CONTEXT before each pass);
printed: each variant's median time, and the median of the pairs' ratios on/off with its quartiles. The shared
machine's speed moves by tens of percent within minutes, so only such interleaved ratios compare.
"""

import statistics
import sys
import time

import torch

from dflash.loading import load_target_cached
from dflash.models import native


def main(argv: list[str]) -> int:
    context = int(argv[0]) if argv else 200
    widths = [int(w) for w in (argv[1] if len(argv) > 1 else "1,16").split(",")]
    pairs = int(argv[2]) if len(argv) > 2 else 60
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "bfloat16")
    if not native.amx():
        print("products do not run through AMX tiles here: nothing to compare", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.forward(torch.randint(100, 40000, (1, context), generator=generator), cache)
    try:
        for width in widths:
            tokens = torch.randint(100, 40000, (1, width), generator=generator)
            times, ratios = {True: [], False: []}, []
            for i in range(pairs):
                pair = {}
                for on in (True, False) if i % 2 else (False, True):
                    native.set_attention_tiles(on)
                    cache.set_lengths([context])
                    start = time.perf_counter()
                    target.forward(tokens, cache)
                    pair[on] = time.perf_counter() - start
                    times[on].append(pair[on])
                ratios.append(pair[True] / pair[False])
            q1, median, q3 = statistics.quantiles(ratios, n=4)
            print(f"context {context} width {width}: on {1000 * statistics.median(times[True]):.2f} ms, off "
                  f"{1000 * statistics.median(times[False]):.2f} ms, on/off median {median:.3f} "
                  f"(quartiles {q1:.3f}-{q3:.3f})")
    finally:
        native.set_attention_tiles(True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
