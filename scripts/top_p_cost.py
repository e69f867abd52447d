"""What choosing a sampled token costs with top-p (temperature 0.7, top_p 0.9, seeded) on SmolLM2-sized logits
(49,152 tokens), one thread: rows as a 16-token verify pass has them, sharp (nucleus in the 256 likeliest) and flat.

    .venv/bin/python scripts/top_p_cost.py                       # this tree
    PYTHONPATH=/path/to/old/src .venv/bin/python scripts/top_p_cost.py   # another commit's, to compare
"""

import time

import torch

from dflash.sampling import SamplingConfig, pick_tokens

torch.set_num_threads(1)
config = SamplingConfig(temperature=0.7, top_p=0.9, seed=1)
generator = torch.Generator().manual_seed(0)


def logits(rows: int, scale: float) -> torch.Tensor:
    return torch.randn(rows, 49152, generator=generator) * scale


CASES = {
    "15 sharp rows + 1 flat": torch.cat([logits(15, 8.0), logits(1, 1.0)]),
    "16 flat-ish rows": logits(16, 3.0),
    "1 flat row": logits(1, 1.0),
    "16 sharp rows": logits(16, 8.0),
    "1 sharp row": logits(1, 8.0),
}
for name, rows in CASES.items():
    for _ in range(2):
        pick_tokens(rows, config, 10)
    start = time.perf_counter()
    for _ in range(20):
        pick_tokens(rows, config, 10)
    print(f"{name:<24} {(time.perf_counter() - start) / 20 * 1e3:7.2f} ms")
