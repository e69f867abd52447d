"""Two builds of native.c's VNNI int8 kernel against each other in ONE process (milliseconds, medians of 30 pairs).

Usage: .venv/bin/python scripts/ab_vnni.py OLD.c NEW.c

Times `native.vnni_product` (the int8 screen's sums, and a drafter's int8 LM head) over SmolLM2-135M's head (49,152
rows) and over its first 16,384 rows (a drafter's draft vocabulary) at 1, 4, 8 and 16 input rows, 2 threads, each
call after a 96 MB write has evicted the head from the caches (as a target pass does in a round). The builds
alternate, the order flipping every pair; each pair's ratio new/old is taken, and its median and 20-80% range
printed. Both builds' outputs must be bitwise equal (checked). To get an OLD.c:
`scripts/native_source.py COMMIT > /tmp/old.c`.
"""

import sys
import time

import torch

from ab_native import load_build
from dflash.loading import load_target_cached
from dflash.models import native
from dflash.models.screening import ScreenedHead

PAIRS = 30


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    builds = {"old": load_build(argv[0]), "new": load_build(argv[1])}
    if not native.int8_vnni():
        sys.exit("no AVX512-VNNI here")
    torch.set_num_threads(2)
    weight = load_target_cached("smollm2-135m", "bfloat16").lm_head.weight.detach()
    heads = {"49K": ScreenedHead(weight, "int8"), "16K": ScreenedHead(weight[:16384].contiguous(), "int8")}
    evict = torch.ones(96 * 2**20 // 4)
    generator = torch.Generator().manual_seed(0)
    for name, head in heads.items():
        for rows in (1, 4, 8, 16):
            x = torch.randn(rows, weight.shape[1], generator=generator)
            seconds, outputs = {"old": [], "new": []}, {}
            for pair in range(PAIRS + 1):
                for label in ("old", "new") if pair % 2 else ("new", "old"):
                    native._library = builds[label]
                    evict.add_(1.0)
                    start = time.perf_counter()
                    outputs[label] = native.vnni_product(x, head.tiles, head.scales, head.weight.shape[0])[0]
                    if pair:
                        seconds[label].append(time.perf_counter() - start)
            if not torch.equal(outputs["old"], outputs["new"]):
                sys.exit(f"{name} rows {rows}: the builds' outputs differ")
            ratios = sorted(n / o for n, o in zip(seconds["new"], seconds["old"]))
            old_ms, new_ms = (1000 * sorted(seconds[k])[PAIRS // 2] for k in ("old", "new"))
            print(f"{name} rows {rows:2d}: old {old_ms:.3f} ms, new {new_ms:.3f} ms, new/old {ratios[PAIRS // 2]:.3f} "
                  f"({ratios[PAIRS // 5]:.3f}-{ratios[-PAIRS // 5]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
