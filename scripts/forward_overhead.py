"""Where a target pass's time goes outside the C layer stack: the pass whole, the C call (native.stack), and the
per-pass check of the stack's arguments (ProductsUnchanged.holds), medians of 300 passes after 300 tokens.

Usage: .venv/bin/python scripts/forward_overhead.py [float32|bfloat16]   (default bfloat16; 2 threads)

Why: after the stack has streamed the weights (212 MB in bfloat16), the interpreter's and torch's own data are out
of the caches, and each small torch op or Python object touched around the C call costs tens of microseconds; hot
in a loop the same code looks ten times cheaper.
"""

import sys
import time

import torch

import dflash.models.native as native
import dflash.models.transformer as transformer
from dflash.loading import load_target_cached, settle_heap


def timed(record: list[float], function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        result = function(*args, **kwargs)
        record.append(time.perf_counter() - started)
        return result
    return wrapper


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "bfloat16"
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    cache = target.new_cache(capacity=400)
    target.forward(torch.arange(5, 305)[None] % 1000, cache)
    settle_heap()
    stack, check = [], []
    transformer.native.stack = timed(stack, native.stack)
    transformer.ProductsUnchanged.holds = timed(check, transformer.ProductsUnchanged.holds)
    median = lambda values: 1e3 * sorted(values)[len(values) // 2]  # noqa: E731
    for width in (1, 16):
        whole = []
        stack.clear(), check.clear()
        ids = torch.arange(5, 5 + width)[None]
        for _ in range(300):
            started = time.perf_counter()
            target.forward(ids, cache, (), logits_at="hidden")
            whole.append(time.perf_counter() - started)
            cache.truncate(300)
        print(f"{dtype}, {width} token(s) after 300: pass {median(whole):.3f} ms, C stack {median(stack):.3f} ms, "
              f"check {median(check):.3f} ms, the rest of the pass's Python "
              f"{median([a - b for a, b in zip(whole, stack)]) - median(check):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
