"""A fresh prompt through the C stack in passes of 64, 128 and 256 tokens, interleaved in one process (the order
flipping every round), by prompt length; the last logits must be bitwise the same whatever the passes.

Usage: .venv/bin/python scripts/prompt_chunk_ab.py [DTYPE] [LENGTHS] [ROUNDS]  (defaults: bfloat16, 300,1024,2048,
7). Two threads, SmolLM2-135M-Instruct, every prompt in C (`Transformer.prompts_in_c_up_to`).
"""

import sys
import time

import torch

from dflash.loading import load_target_cached, settle_heap
from dflash.models.transformer import EVERY_PROMPT

PROMPT_CHUNKS = (64, 128, 256)  # the engine times 64 and 256 (transformer.PROMPT_CHUNKS); 128 here too


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "bfloat16"
    lengths = [int(n) for n in (argv[1] if len(argv) > 1 else "300,1024,2048").split(",")]
    rounds = int(argv[2]) if len(argv) > 2 else 7
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    settle_heap()  # no full pass of the garbage collector over the loaded model inside the timings
    engine = target.engine
    engine.prompts_in_c_up_to = EVERY_PROMPT
    ids = torch.randint(100, 40000, (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    for n in lengths:
        seconds, last = {chunk: [] for chunk in PROMPT_CHUNKS}, {}
        for round_ in range(rounds + 1):  # the first round warms up and is dropped
            for chunk in PROMPT_CHUNKS if round_ % 2 == 0 else PROMPT_CHUNKS[::-1]:
                engine.prompt_chunk = chunk
                start = time.perf_counter()
                last[chunk] = target.forward(ids[:, :n], target.new_cache(1, n), logits_at="last").logits
                if round_:
                    seconds[chunk].append(time.perf_counter() - start)
        base = seconds[PROMPT_CHUNKS[0]]
        cells = []
        for chunk in PROMPT_CHUNKS:
            ratios = sorted(b / a for a, b in zip(base, seconds[chunk]))
            same = torch.equal(last[chunk], last[PROMPT_CHUNKS[0]])
            cells.append(f"{chunk}: {1e3 * sorted(seconds[chunk])[rounds // 2]:.0f} ms, x{ratios[rounds // 2]:.3f}"
                         f" ({ratios[0]:.2f}-{ratios[-1]:.2f}){'' if same else ' DIFFERENT LOGITS'}")
        print(f"{dtype} prompt of {n} tokens, passes of " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
