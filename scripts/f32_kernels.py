"""Float32 passes of 1-16 tokens under each kernel for float32 panels this CPU runs (native.f32_kernel), interleaved
(milliseconds, medians of 15 rounds; SmolLM2-135M after 200 tokens of context, 2 threads), with each kernel's
16-token pass against its own step. Outputs are bitwise the same under every kernel; only the time differs.

Usage: .venv/bin/python scripts/f32_kernels.py [--json FILE]

The library picks between "avx512" and "avx512-zmm" when it loads (native._zmm_measures_faster); this shows what
the choice is worth on whole passes.
"""

import json
import sys

import torch

from dflash.loading import load_target_cached
from dflash.models import native
from dflash.models.target import interleaved_medians

WIDTHS = (1, 2, 4, 8, 16)


def main(argv: list[str]) -> int:
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "float32")
    kernels = native.f32_kernels_here()
    if not kernels:
        sys.exit(f"no native kernel here: {native.why_not}")
    chosen = native.f32_kernel()
    cache = target.new_cache(capacity=300)
    target.forward(torch.full((1, 200), 5), cache)

    def call(kernel: str, width: int):
        def run():
            native.set_f32_kernel(kernel)
            target.forward(torch.full((1, width), 7), cache, logits_at="all")
            cache.truncate(200)
        return run

    table = {}
    try:
        for width in WIDTHS:
            table[width] = {k: 1000 * s for k, s in interleaved_medians({k: call(k, width) for k in kernels}, 15).items()}
            print(f"{width:2d} tokens: " + "  ".join(f"{k} {ms:.1f} ms" for k, ms in table[width].items()), flush=True)
    finally:
        native.set_f32_kernel(chosen)
    print("16 tokens / a step: " + "  ".join(f"{k} {table[16][k] / table[1][k]:.2f}x" for k in kernels))
    print(f"chosen when the library loaded: {chosen}")
    if "--json" in argv:
        record = {"cpu": native.cpu_description(), "chosen": chosen, "ms": table}
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
