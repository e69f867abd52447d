"""Weight tiles and KV caches on huge pages against 4 KB pages, in ONE process, pass by pass (models/memory.py).

Usage: .venv/bin/python scripts/ab_pages.py [verify|batch] [float32|bfloat16]

  verify (default): SmolLM2-135M at 200 cached positions, a decode step and a 16-token verify pass, 2 threads;
  batch: a decode step of 16 rows at 600 positions each on 1 thread, as `dflash data --threads 1` runs.

Two copies of the target are loaded, the first with memory.enabled off (torch's allocations, 4 KB pages where
transparent huge pages are in "madvise" mode), the second with it on; their passes alternate, the order flipping
every round, and each pair's ratio huge/4K is taken (medians of 15 pairs), as scripts/ab_native.py does for two
builds of the kernels.
"""

import sys

import torch

from dflash.models import memory
from dflash.models.target import load_target
from paired import alternate, report


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else "verify"
    dtype = argv[1] if len(argv) > 1 else "float32"
    rows, context, widths, threads = (16, 600, (1,), 1) if mode == "batch" else (1, 200, (1, 16), 2)
    torch.set_num_threads(threads)
    targets, caches = {}, {}
    for pages in ("4K", "huge"):
        memory.enabled = pages == "huge"
        targets[pages] = load_target("smollm2-135m", dtype)
        caches[pages] = targets[pages].new_cache(rows, context + 64)
        targets[pages].forward(torch.randint(100, 10000, (rows, context)), caches[pages])  # makes the tiles too

    def run(pages: str, width: int) -> None:
        targets[pages].forward(torch.randint(100, 10000, (rows, width)), caches[pages])
        caches[pages].set_lengths([context] * rows)

    labels = ("4K", "huge")
    report(f"{mode} {dtype} rows {rows} threads {threads}", labels, widths, alternate(labels, widths, run))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
