"""The LM head's two paths after a pass, each way interleaved (milliseconds, medians of 15 rounds; SmolLM2-135M after
200 tokens of context, 2 threads): the int8 screen (greedy rounds) through AMX tiles or VPDPBUSD, and the full head
(sampled rounds) written as float32 by our kernel or as bfloat16 then widened by torch (bfloat16 targets only).

Usage: .venv/bin/python scripts/head_ab.py [float32|bfloat16]

Each head call follows a pass of its width, which evicts the head from the caches, as in a round.
"""

import statistics
import sys
import time

import torch

from dflash.loading import load_target_cached
from dflash.models import native

WIDTHS = (1, 2, 4, 8, 16)


def main(argv: list[str]) -> int:
    torch.set_num_threads(2)
    dtype = argv[0] if argv else "bfloat16"
    target = load_target_cached("smollm2-135m", dtype)
    cache = target.new_cache(capacity=300)
    target.forward(torch.full((1, 200), 5), cache)
    head, norm = target.engine.head, target.engine.norm
    ways = {"screen, VPDPBUSD": lambda h: (native.set_screen_tiles(False), target.engine.greedy(h, "int8")),
            "screen, tiles": lambda h: (native.set_screen_tiles(True), target.engine.greedy(h, "int8"))}
    if not native.library().dflash_screen_tiles():
        ways = {}
        print("no AMX-INT8 here: the screen runs VPDPBUSD only")
    if dtype == "bfloat16":
        ways["head, bfloat16 then float"] = lambda h: head(norm.rows(h)).float()
        ways["head, float out"] = lambda h: head.float_out(norm.rows(h))
    chosen = native.screen_tiles()
    times = {}
    try:
        for run in range(16):
            for width in WIDTHS:
                for name in (list(ways) if run % 2 else list(reversed(ways))):
                    hidden = target.forward(torch.full((1, width), 7), cache, logits_at="hidden").hidden
                    start = time.perf_counter()
                    ways[name](hidden)
                    if run:  # the first round warms up
                        times.setdefault((width, name), []).append(time.perf_counter() - start)
                    cache.truncate(200)
    finally:
        native.set_screen_tiles(chosen)
    for width in WIDTHS:
        print(f"{width:2d} tokens: " + "  ".join(f"{name} {1000 * statistics.median(times[(width, name)]):.2f} ms"
                                                 for name in ways))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
