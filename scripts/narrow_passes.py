"""Passes of 1-5 tokens under each way narrow products read the panels (native.narrow_passes), interleaved
(milliseconds, medians of 15 rounds; SmolLM2-135M after 200 tokens of context, 2 threads).

Usage: .venv/bin/python scripts/narrow_passes.py [float32|bfloat16|int8]

The engine picks a way per machine at load (target.choose_narrow_passes); this prints what each way costs, plus
"one-panel-step" (one panel for a step too), which made float32 steps slower on an Intel Xeon.
"""

import sys

import torch

from dflash.loading import load_target_cached
from dflash.models import native
from dflash.models.target import interleaved_medians

WAYS = {**native.NARROW_PASSES, "one-panel-step": (0, 2)}


def main(argv: list[str]) -> int:
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", argv[0] if argv else "float32")
    lib = native.library()
    if lib is None:
        sys.exit(f"no native kernel here: {native.why_not}")
    cache = target.new_cache(capacity=300)
    target.forward(torch.full((1, 200), 5), cache)

    def call(setting: tuple[int, int], width: int):
        def run():
            lib.dflash_set_narrow_passes(*setting)
            target.forward(torch.full((1, width), 7), cache, logits_at="all")
            cache.truncate(200)
        return run

    for width in (1, 2, 3, 4, 5):
        medians = interleaved_medians({way: call(setting, width) for way, setting in WAYS.items()}, 15)
        print(f"{width} tokens: " + "  ".join(f"{way} {1000 * s:.1f} ms" for way, s in medians.items()))
    native.set_narrow_passes(native.narrow_passes())  # back to the way in force
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
