"""A fresh prompt's pass two ways, interleaved in one process, by prompt length (scripts/paired.py; AB_PAIRS pairs):

  causal: torch's layers with attention by SDPA's causal kernel (`sdpa_backends.CAUSAL`) against a mask of bools;
          the outputs must agree bitwise;
  c:      the C stack (`Transformer.prompts_in_c_up_to`, passes of `prompt_chunk`), against torch's layers whole
          (CAUSAL); the largest difference of the last logits is printed.

Usage: .venv/bin/python scripts/prefill_ab.py [causal|c] [DTYPE] [LENGTHS]
       (defaults: c, bfloat16, 48,100,200,400,800). Two threads.
"""

import sys

import torch

import paired
from dflash.loading import load_target_cached
from dflash.models import transformer
from dflash.models.transformer import EVERY_PROMPT
from dflash.models.layers import causal_mask


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else "c"
    dtype = argv[1] if len(argv) > 1 else "bfloat16"
    lengths = tuple(int(n) for n in (argv[2] if len(argv) > 2 else "48,100,200,400,800").split(","))
    if mode not in ("causal", "c"):
        print(f"unknown mode {mode!r}: causal or c", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    engine = target.engine
    ids = torch.randint(100, 40000, (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    as_built = transformer.Transformer.__dict__["_mask"]  # the staticmethod itself
    with_bools = staticmethod(lambda positions, starts, n, end, window: causal_mask(positions, end, window))
    labels = ("mask", "causal") if mode == "causal" else ("torch", "c")
    last = {}

    def run(label: str, n: int) -> None:
        engine.prompts_in_c_up_to = EVERY_PROMPT if label == "c" else 0
        transformer.Transformer._mask = with_bools if label == "mask" else as_built
        try:
            last[label, n] = target.forward(ids[:, :n], target.new_cache(1, n), logits_at="last").logits
        finally:
            transformer.Transformer._mask = as_built

    seconds = paired.alternate(labels, lengths, run)
    paired.report(f"{dtype} prompt", labels, lengths, seconds)
    for n in lengths:
        difference = (last[labels[0], n] - last[labels[1], n]).abs().max().item()
        print(f"{n} tokens: last logits differ by at most {difference:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
