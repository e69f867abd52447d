"""A decode step and a 16-token verify pass of the real target, twice each (milliseconds, medians of 21 passes).

Usage: .venv/bin/python scripts/step_verify.py [float32|bfloat16] [--widths 1,2,3,4,16] [--threads N]
(--widths: the passes to time instead, each printed with its ratio to the first; --threads: default 2)

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
    dtype = argv[0] if argv and not argv[0].startswith("--") else "float32"
    widths = [int(w) for w in argv[argv.index("--widths") + 1].split(",")] if "--widths" in argv else None
    torch.set_num_threads(int(argv[argv.index("--threads") + 1]) if "--threads" in argv else 2)
    target = load_target_cached("smollm2-135m", dtype=dtype)
    cache, context = target.new_cache(), 200
    target.forward(torch.arange(5, 5 + context)[None], cache)
    for width in widths or (1, 16):  # warm-up
        median_ms(target, cache, width, context, 3)
    if widths:
        readings = [[median_ms(target, cache, w, context, 21) for w in widths] for _ in range(2)]
        print(native.build_id(), dtype, "  |  ".join(" ".join(f"{w}: {ms:5.1f} ms ({ms / row[0]:.2f}x)"
                                                            for w, ms in zip(widths, row)) for row in readings))
        return 0
    readings = [(median_ms(target, cache, 1, context, 21), median_ms(target, cache, 16, context, 21)) for _ in range(2)]
    print(native.build_id(), dtype, "  ".join(f"step {a:5.1f} verify-16 {b:5.1f}" for a, b in readings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
