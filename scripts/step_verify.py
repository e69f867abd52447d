"""A decode step and a 16-token verify pass of the real target, twice each (milliseconds, medians of 21 passes).

Usage: .venv/bin/python scripts/step_verify.py [float32|bfloat16] [--widths 1,2,3,4,16] [--threads N]
                                              [--contexts 200,2000,4000]
(--widths: the passes to time instead, each printed with its ratio to the first; --threads: default 2;
--contexts: the passes after each of these many tokens, default 200)

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
    contexts = [int(c) for c in argv[argv.index("--contexts") + 1].split(",")] if "--contexts" in argv else [200]
    target = load_target_cached("smollm2-135m", dtype=dtype)
    for context in contexts:
        cache = target.new_cache(1, max(512, context + 64))
        for start in range(0, context, 256):  # the prompt in passes of 256, as long prompts go
            tokens = torch.arange(5 + start, 5 + min(context, start + 256)) % 40000
            target.forward(tokens[None], cache, logits_at="last")
        print(f"after {context} tokens:", end=" ")
        time_passes(target, cache, context, dtype, widths)
    return 0


def time_passes(target, cache, context: int, dtype: str, widths: list[int] | None) -> None:
    for width in widths or (1, 16):  # warm-up
        median_ms(target, cache, width, context, 3)
    if widths:
        readings = [[median_ms(target, cache, w, context, 21) for w in widths] for _ in range(2)]
        print(native.build_id(), dtype, "  |  ".join(" ".join(f"{w}: {ms:5.1f} ms ({ms / row[0]:.2f}x)"
                                                            for w, ms in zip(widths, row)) for row in readings))
        return
    readings = [(median_ms(target, cache, 1, context, 21), median_ms(target, cache, 16, context, 21)) for _ in range(2)]
    print(native.build_id(), dtype, "  ".join(f"step {a:5.1f} verify-16 {b:5.1f}" for a, b in readings))

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
