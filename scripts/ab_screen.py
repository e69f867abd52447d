"""Two builds of native.c against each other in ONE process on the LM head's int8 screen alone (milliseconds).

Usage: .venv/bin/python scripts/ab_screen.py OLD.c NEW.c [DTYPE] [ROWS]
(defaults float32, 1 row; SmolLM2-135M, 2 threads; run from the repository root)

Each of 40 rounds (after one dropped to warm up) runs, for each build in turn (the order flipping every round), a pass of ROWS tokens after 200
tokens of context (untimed: it evicts the head from the caches, as a round does), then times only the greedy token
through the int8 screen; both builds' tokens must be the same. Prints each build's median and the median (range) of
new / old per round. The screen is a few percent of a step, so a whole-pass A/B (scripts/ab_native.py) cannot
separate it. To get an OLD.c: `scripts/native_source.py COMMIT > /tmp/old.c`.
"""

import statistics
import sys
import time

import torch

from ab_native import load_build
from dflash.loading import load_target_cached
from dflash.models import native

ROUNDS = 40


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    builds = {"old": load_build(argv[0]), "new": load_build(argv[1])}
    dtype, rows = (argv[2] if len(argv) > 2 else "float32"), int(argv[3]) if len(argv) > 3 else 1
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    cache = target.new_cache(capacity=300)
    target.forward(torch.tensor([[5 + i % 50 for i in range(200)]]), cache)
    seconds, ratios = {"old": [], "new": []}, []
    for i in range(ROUNDS + 1):  # the first round warms both builds up (a screen's first call lays it out): dropped
        took, tokens = {}, {}
        for build in ("old", "new") if i % 2 == 0 else ("new", "old"):
            native._library = builds[build]
            hidden = target.forward(torch.tensor([[7 + i] * rows]), cache, logits_at="hidden").hidden
            started = time.perf_counter()
            tokens[build] = target.engine.greedy(hidden, "int8").tolist()
            took[build] = time.perf_counter() - started
            cache.truncate(200)
        assert tokens["old"] == tokens["new"], "the builds chose different tokens"
        if i == 0:
            continue
        for build in took:
            seconds[build].append(took[build])
        ratios.append(took["new"] / took["old"])
    print(f"{dtype}, {rows} row(s): screen old {1e3 * statistics.median(seconds['old']):.2f} ms, new "
          f"{1e3 * statistics.median(seconds['new']):.2f} ms, new/old median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
