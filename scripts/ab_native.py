"""Two builds of native.c against each other in ONE process, pass by pass (milliseconds, medians of 15 pairs).

Usage: .venv/bin/python scripts/ab_native.py OLD.c NEW.c [verify|layers|batch|screen] [float32|bfloat16] [CONTEXT]

  verify (default): SmolLM2-135M at CONTEXT (200) cached positions, a decode step and a 16-token verify pass, 2
  threads;
  layers: the same passes without the LM head (the decoder layers alone);
  batch: a decode step of 16 rows at 600 positions each on 1 thread, as `dflash data --threads 1` runs;
  screen: the greedy tokens of a pass's hidden rows through the LM head's int8 screen (`TargetModel.greedy_of`),
  after a pass of that width at CONTEXT positions.
AB_WIDTHS=1,5,8,16 times those pass widths instead of a step and 16 tokens (verify, layers and screen modes).

Why: on a shared 2-core machine whole-pass timings of one build move by 20-50% within minutes, so builds timed in
turn (scripts/step_verify.py) cannot separate a 5% change. Here both libraries are loaded side by side (ctypes
loads each with its own symbols) and the passes alternate between them, the order flipping every round, on the
same weights (both builds must share the tile layout) and the same cache. Each pair's ratio new/old is taken, and
their median and range printed. To get an OLD.c: `scripts/native_source.py COMMIT > /tmp/old.c`.
"""

import os
import sys
from pathlib import Path

import torch

from dflash.loading import load_target_cached
from dflash.models import native
from paired import alternate, report


def load_build(source: str):
    native.SOURCE, native._tried, native._library = Path(source), False, None
    lib = native.library()
    if lib is None:
        sys.exit(f"cannot build {source}: {native.why_not}")
    return lib


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    old, new = load_build(argv[0]), load_build(argv[1])
    mode = argv[2] if len(argv) > 2 else "verify"
    dtype = argv[3] if len(argv) > 3 else "float32"
    rows, context, widths, threads = (16, 600, (1,), 1) if mode == "batch" else (1, 200, (1, 16), 2)
    if mode != "batch" and os.environ.get("AB_WIDTHS"):
        widths = tuple(int(w) for w in os.environ["AB_WIDTHS"].split(","))
    context = int(argv[4]) if len(argv) > 4 else context
    torch.set_num_threads(threads)
    target = load_target_cached("smollm2-135m", dtype=dtype)
    cache = target.new_cache(rows, context + 64)
    target.forward(torch.randint(100, 10000, (rows, context)), cache)
    hidden = {}
    if mode == "screen":
        target.screen_greedy, target.screen_kind = True, "int8"
        for width in widths:
            hidden[width] = target.forward(torch.randint(100, 10000, (rows, width)), cache, (),
                                           logits_at="hidden").hidden[0]
            cache.set_lengths([context] * rows)

    def run(build: str, width: int) -> None:
        native._library = old if build == "old" else new
        if mode == "screen":
            target.greedy_of(hidden[width]).tolist()
            return
        ids = torch.randint(100, 10000, (rows, width))
        if mode == "layers":
            target.forward(ids, cache, (), logits_at="hidden")
        else:
            target.forward(ids, cache)
        cache.set_lengths([context] * rows)

    labels = ("old", "new")
    report(f"{mode} {dtype} rows {rows} threads {threads}", labels, widths, alternate(labels, widths, run))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
