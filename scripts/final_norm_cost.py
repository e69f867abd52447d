"""A greedy token's final norm and LM-head screen after a step, cold as in a round: torch's norm and then the screen
(before the thirty-second session) against the norm taken inside the screen's C call (`greedy_of` now), alternating.

Usage: .venv/bin/python scripts/final_norm_cost.py [float32|bfloat16]   (default bfloat16; SmolLM2 after 300
tokens, 400 pairs, medians in microseconds; 2 threads)
"""

import statistics
import sys
import time

import torch

from dflash.loading import load_target_cached, settle_heap


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "bfloat16"
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    target.screen_greedy = True
    engine = target.engine
    screen = engine.screen(target.screen_kind)
    cache = target.new_cache(capacity=400)
    target.forward(torch.arange(5, 305)[None] % 1000, cache)
    settle_heap()
    times = {"torch norm, then the screen": [], "the norm inside the screen": []}
    with torch.inference_mode():
        for i in range(800):
            way = list(times)[i % 2]
            hidden = target.forward(torch.tensor([[7]]), cache, (), logits_at="hidden").hidden
            cache.truncate(300)
            started = time.perf_counter()
            if i % 2 == 0:
                screen.argmax(engine.norm(hidden))
            else:
                target.greedy_of(hidden)
            times[way].append(time.perf_counter() - started)
    print(f"{dtype}, {target.screen_kind} screen:")
    for way, seconds in times.items():
        print(f"  {way}: {1e6 * statistics.median(seconds):.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
