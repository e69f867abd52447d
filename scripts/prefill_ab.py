"""A fresh prompt's prefill with attention run by SDPA's causal kernel (`sdpa_backends.CAUSAL`) against the same
pass given a mask of bools, interleaved in one process, by prompt length (scripts/paired.py; AB_PAIRS pairs).
Outputs are compared too: the two must agree bitwise.

Usage: .venv/bin/python scripts/prefill_ab.py [DTYPE] [LENGTHS]   (defaults: bfloat16; 64,256,1024,2048). Two threads.
"""

import sys

import torch

import paired
from dflash.loading import load_target_cached
from dflash.models import transformer
from dflash.models.layers import causal_mask


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "bfloat16"
    lengths = tuple(int(n) for n in (argv[1] if len(argv) > 1 else "64,256,1024,2048").split(","))
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    ids = torch.randint(100, 40000, (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    as_built = transformer.Transformer.__dict__["_mask"]  # the staticmethod itself
    with_bools = staticmethod(lambda positions, starts, n, end, window: causal_mask(positions, end, window))
    last = {}

    def run(label: str, n: int) -> None:
        transformer.Transformer._mask = as_built if label == "causal" else with_bools
        try:
            last[label, n] = target.forward(ids[:, :n], target.new_cache(1, n), logits_at="last").logits
        finally:
            transformer.Transformer._mask = as_built

    labels = ("mask", "causal")
    seconds = paired.alternate(labels, lengths, run)
    paired.report(f"{dtype} prefill", labels, lengths, seconds)
    for n in lengths:
        print(f"{n} tokens: last logits {'equal' if torch.equal(last['mask', n], last['causal', n]) else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
