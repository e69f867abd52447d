"""Attention's value sums in AVX-512 registers (native.c's values64) against head by head over a widened copy,
in ONE build, pass by pass (milliseconds, medians of PAIRS pairs, the order flipping every pair). Both give
bitwise the same outputs; only the time differs.

Usage: .venv/bin/python scripts/ab_values.py [CONTEXT] [float32|bfloat16] [PAIRS]   (defaults: 300 bfloat16 31)
"""

import sys

import torch

import paired
from dflash.loading import load_target_cached
from dflash.models import native

WIDTHS = (1, 2, 4, 8, 16)


def main(argv: list[str]) -> int:
    context = int(argv[0]) if argv else 300
    dtype = argv[1] if len(argv) > 1 else "bfloat16"
    paired.PAIRS = int(argv[2]) if len(argv) > 2 else 31
    native.set_values_in_registers(True)
    if not native.set_values_in_registers(True):  # returns the setting the first call made
        sys.exit("this CPU lacks AVX-512F: attention sums its values head by head only")
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype=dtype)
    cache = target.new_cache(1, context + 64)
    target.forward(torch.randint(100, 10000, (1, context)), cache)

    def run(label: str, width: int) -> None:
        native.set_values_in_registers(label == "registers")
        target.forward(torch.randint(100, 10000, (1, width)), cache)
        cache.set_lengths([context])

    labels = ("block", "registers")
    paired.report(f"{dtype} after {context} tokens", labels, WIDTHS, paired.alternate(labels, WIDTHS, run))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
