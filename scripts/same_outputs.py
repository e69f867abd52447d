"""Two builds of native.c give bitwise the same logits on the real model: passes of 1-16 tokens after 20, 100 and
333 tokens of context, each run through both builds on the same cache. A change meant to be bitwise neutral
(a faster kernel summing the same chains) must print "all same".

Usage: .venv/bin/python scripts/same_outputs.py OLD.c NEW.c [float32|bfloat16]
(to get an OLD.c: `scripts/native_source.py COMMIT > /tmp/old.c`)
"""

import sys

import torch

from ab_native import load_build
from dflash.loading import load_target_cached
from dflash.models import native


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    builds = load_build(argv[0]), load_build(argv[1])
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype=argv[2] if len(argv) > 2 else "bfloat16")
    generator = torch.Generator().manual_seed(0)
    differ = 0
    for context in (20, 100, 333):
        cache = target.new_cache(1, context + 64)
        target.forward(torch.randint(100, 10000, (1, context), generator=generator), cache)
        for width in (1, 2, 3, 5, 8, 16):
            ids = torch.randint(100, 10000, (1, width), generator=generator)
            logits = []
            for build in builds:
                native._library = build
                logits.append(target.forward(ids, cache, (3, 10)).logits)
                cache.set_lengths([context])
            same = torch.equal(*logits)
            differ += not same
            gap = "" if same else f" (largest difference {(logits[0].float() - logits[1].float()).abs().max().item():.3g})"
            print(f"context {context:3d} width {width:2d}: {'same' if same else 'DIFFERENT'}{gap}")
    print("all same" if not differ else f"{differ} passes differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
