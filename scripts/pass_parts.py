"""A target pass's two parts by width, after a given context: its decoder layers and the greedy token through the
LM head's screen (milliseconds, medians of 15 rounds, widths interleaved).

Usage: .venv/bin/python scripts/pass_parts.py [DTYPES] [CONTEXT] [--screen int8|bfloat16]
(DTYPES: float32, bfloat16 or int8, or several with commas, timed round by round in turn, each against the first
too; defaults: float32, 200 tokens of context, the int8 screen; 2 threads)

Why: a wide pass's attention grows with the context its tokens attend to, and the screen with its rows; profile
and step_verify time whole passes after 200 tokens. To compare two builds of native.c, run it in turn for each.
"/ step": the median over rounds of a pass's total over the same round's step (the machine's load moves between
rounds; the medians of each width apart can meet different moments).
"""

import sys
import time

import torch

from dflash.loading import load_target_cached

WIDTHS = (1, 2, 3, 4, 5, 8, 16)


def main(argv: list[str]) -> int:
    dtypes = (argv[0] if argv and not argv[0].startswith("--") else "float32").split(",")
    context = int(argv[1]) if len(argv) > 1 and not argv[1].startswith("--") else 200
    torch.set_num_threads(2)
    timers = {dtype: pass_timer(dtype, context, argv) for dtype in dtypes}
    readings = {(d, w): [] for d in dtypes for w in WIDTHS}
    for _ in range(16):
        for w in WIDTHS:
            for d in dtypes:  # interleaved: each dtype meets the same moments of the machine's load
                readings[d, w].append(timers[d](w))
    for d in dtypes:
        print(f"{d}, {context} tokens of context, {timers[d].screen_kind} screen, 2 threads")
        for w in WIDTHS:
            layers = sorted(r[0] for r in readings[d, w][1:])[7]
            screen = sorted(r[1] for r in readings[d, w][1:])[7]
            # each round's pass over its own step, minutes apart rounds meeting different loads: the median ratio
            ratio = sorted(sum(a) / sum(b) for a, b in zip(readings[d, w][1:], readings[d, 1][1:]))[7]
            against = "" if d == dtypes[0] else "  / {} {:.2f}".format(dtypes[0], sorted(
                sum(a) / sum(b) for a, b in zip(readings[d, w][1:], readings[dtypes[0], w][1:]))[7])
            print(f"width {w:2d}: layers {layers:6.2f} ms  screen {screen:5.2f} ms  total {layers + screen:6.2f} ms  "
                  f"/ step {ratio:.2f}{against}")
    return 0


def pass_timer(dtype: str, context: int, argv: list[str]):
    """timed(width) -> (layers ms, screen ms) of one pass of `width` tokens after `context` tokens, rolled back"""
    target = load_target_cached("smollm2-135m", dtype)
    target.screen_greedy = True
    target.screen_kind = argv[argv.index("--screen") + 1] if "--screen" in argv else "int8"
    cache = target.new_cache(capacity=context + max(WIDTHS) + 1)
    target.forward(torch.arange(5, 5 + context)[None] % 1000, cache)

    def timed(width: int) -> tuple[float, float]:
        started = time.perf_counter()
        out = target.forward(torch.arange(5, 5 + width)[None], cache, (), logits_at="hidden")
        middle = time.perf_counter()
        target.greedy_of(out.hidden[0]).tolist()
        ended = time.perf_counter()
        cache.truncate(context)
        return 1000 * (middle - started), 1000 * (ended - middle)

    timed.screen_kind = target.screen_kind
    return timed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
