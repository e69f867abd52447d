"""A tree pass through the C layer stack against torch's layers, by width: the figures behind RESULTS' "Wide tree
passes in C". Binary trees of N nodes after a CONTEXT-token prompt, best of REPEATS each, the two ways
interleaved (the C way forced off through `Transformer._tree_in_c`).

Usage: .venv/bin/python scripts/time_tree_pass.py [DTYPE] [WIDTHS] [CONTEXT] [REPEATS]
(defaults: float32 16,32,64 300 5; SmolLM2-135M-Instruct, 2 threads)
"""

import sys
import time

import torch

from dflash.loading import load_target_cached
from dflash.models.transformer import Transformer


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "float32"
    widths = [int(w) for w in (argv[1] if len(argv) > 1 else "16,32,64").split(",")]
    context = int(argv[2]) if len(argv) > 2 else 300
    repeats = int(argv[3]) if len(argv) > 3 else 5
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    cache = target.new_cache(capacity=context + max(widths) + 1)
    target.forward(torch.tensor([[5 + i % 50 for i in range(context)]]), cache)
    in_c = Transformer._tree_in_c
    logits_at = "hidden" if target.defers_logits else "all"
    for n in widths:
        tree = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, n)]])
        best = {"C": float("inf"), "torch": float("inf")}
        for _ in range(repeats):
            for way in best:
                Transformer._tree_in_c = in_c if way == "C" else (lambda self, n, end: False)
                started = time.perf_counter()
                target.forward(torch.tensor([[7] * n]), cache, logits_at=logits_at, tree=tree)
                best[way] = min(best[way], time.perf_counter() - started)
                cache.truncate(context)
        Transformer._tree_in_c = in_c
        print(f"{dtype}, {n}-node tree after {context} tokens: C {1000 * best['C']:.1f} ms, "
              f"torch layers {1000 * best['torch']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
