"""A bfloat16 target's pass layers with attention scored in pairs (VDPBF16PS) against FMAs over widened keys,
interleaved in one process, by width, after a given context (milliseconds, medians of 15).

Usage: .venv/bin/python scripts/attention_pairs_ab.py [CONTEXT] [WIDTHS]   (default: 1000 tokens; 1,2,4,8,16)
Needs an AVX512-BF16 CPU (the products then run in pairs too, in both variants). Two threads.
"""

import sys
import time

import torch

from dflash.loading import load_target_cached
from dflash.models import native


def main(argv: list[str]) -> int:
    context = int(argv[0]) if argv else 1000
    widths = [int(w) for w in (argv[1] if len(argv) > 1 else "1,2,4,8,16").split(",")]
    torch.set_num_threads(2)
    if not native.bf16_pairs():
        print("this CPU or build has no AVX512-BF16: attention is scored with FMAs only", file=sys.stderr)
        return 1
    target = load_target_cached("smollm2-135m", "bfloat16")
    cache = target.new_cache(capacity=context + max(widths) + 1)
    target.forward(torch.randint(100, 1000, (1, context)), cache)
    times = {(pairs, w): [] for pairs in (False, True) for w in widths}
    try:
        for rep in range(15):
            for w in widths:
                for pairs in ((False, True) if rep % 2 == 0 else (True, False)):
                    native.set_attention_pairs(pairs)
                    ids = torch.randint(100, 1000, (1, w))
                    start = time.perf_counter()
                    target.forward(ids, cache, logits_at="hidden")
                    times[pairs, w].append(time.perf_counter() - start)
                    cache.truncate(context)
    finally:
        native.set_attention_pairs(True)
    for w in widths:
        fma, pairs = (1000 * sorted(times[p, w])[7] for p in (False, True))
        print(f"context {context}, width {w:2d}: FMAs {fma:6.2f} ms, pairs {pairs:6.2f} ms ({pairs / fma:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
