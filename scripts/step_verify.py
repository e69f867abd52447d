"""A decode step and a 16-token verify pass of the real target, twice each (milliseconds, medians of 21 passes).

Usage: .venv/bin/python scripts/step_verify.py [float32|bfloat16]

Short on purpose: to compare builds on a noisy machine, run it in turn for each checkout, several rounds,
e.g. `for r in 1 2 3; do for t in ../old .; do PYTHONPATH=$t/src .venv/bin/python scripts/step_verify.py; done; done`
(each line names the kernel build it ran).
"""

import sys

import torch

from bench_threads import median_ms
from dflash.loading import load_target_cached
from dflash.models import native


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "float32"
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype=dtype)
    cache, context = target.new_cache(), 200
    target.forward(torch.arange(5, 5 + context)[None], cache)
    for width in (1, 16):  # warm-up
        median_ms(target, cache, width, context, 3)
    readings = [(median_ms(target, cache, 1, context, 21), median_ms(target, cache, 16, context, 21)) for _ in range(2)]
    print(native.build_id(), dtype, "  ".join(f"step {a:5.1f} verify-16 {b:5.1f}" for a, b in readings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
