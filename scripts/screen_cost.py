"""What the greedy token of a pass costs through the float32 LM head and through each screen (models/screening.py).

Usage: .venv/bin/python scripts/screen_cost.py [ROWS] [THREADS] [REPEATS] [DTYPE]
       (defaults: 1 row, 2 threads, 40, float32; bfloat16 times a bfloat16 target's head)

Each repeat runs, for every variant in turn, a pass of ROWS tokens after 200 tokens of context (as a round does: the
pass evicts the head from the caches), then times only the token choice: the float32 head's logits and argmax, or
the screen's. Prints medians in milliseconds and how many tokens each screen summed exactly (median and most, per
row); every variant's tokens are checked to be the head's.
"""

import statistics
import sys
import time

import torch

from dflash.loading import load_target_cached
from dflash.models.screening import KINDS


def main(argv: list[str]) -> int:
    rows = int(argv[0]) if argv else 1
    torch.set_num_threads(int(argv[1]) if len(argv) > 1 else 2)
    repeats = int(argv[2]) if len(argv) > 2 else 40
    dtype = argv[3] if len(argv) > 3 else "float32"
    target = load_target_cached("smollm2-135m", dtype)
    cache = target.new_cache(capacity=300)
    target.forward(torch.tensor([[5 + i % 50 for i in range(200)]]), cache)
    seconds = {name: [] for name in (f"{dtype} head", *KINDS)}
    summed = {kind: [] for kind in KINDS}
    for i in range(repeats):
        for name in seconds:
            hidden = target.forward(torch.tensor([[7 + i] * rows]), cache, logits_at="hidden").hidden
            started = time.perf_counter()
            if name in KINDS:
                tokens = target.engine.greedy(hidden, name)
            else:
                tokens = target.logits_of(hidden).argmax(-1)
            seconds[name].append(time.perf_counter() - started)
            cache.truncate(200)
            if name in KINDS:
                summed[name] += target.engine.screen(name).last_screened.tolist()
                assert tokens.tolist() == reference, f"{name} chose other tokens than the head"
            else:
                reference = tokens.tolist()
    print(f"{dtype} target, {rows} row(s), {torch.get_num_threads()} threads, medians of {repeats}: " + ", ".join(
        f"{name} {1000 * statistics.median(s):.2f} ms" for name, s in seconds.items()))
    print("tokens summed in float32 per row (median, most): " + ", ".join(
        f"{kind} {statistics.median(summed[kind]):g}, {max(summed[kind])}" for kind in KINDS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
