"""Cost of the pieces of one speculative round on the default target (median of 10 runs, milliseconds).

Usage: .venv/bin/python scripts/profile_round.py [float32|bfloat16] [THREADS]
"""

import sys
import time

import torch

from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions


def median_ms(fn, runs: int = 10) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[runs // 2]


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    target = load_target_cached("smollm2-135m", dtype)
    proposer, _ = build_proposer("dflash", target, MethodOptions(draft_dtype="bfloat16"))
    prompt = target.encode_prompt("Janet's ducks lay 16 eggs per day. How much does she make every day?")
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache)
    length = len(cache)

    def verify(n, layers=()):
        def run():
            target.forward(torch.tensor([[5] * n]), cache, layers)
            cache.truncate(length)
        return run

    layers = proposer.feature_layers
    print(f"target {dtype}, drafter bfloat16, {torch.get_num_threads()} threads")
    print(f"target forward, 1 token (ar step): {median_ms(verify(1)):7.1f} ms")
    for n in (2, 3, 4, 8, 16):  # a verify pass costs what the kernels for its width cost, not n times a step
        print(f"target verify, {n:2d} tokens + features: {median_ms(verify(n, layers)):7.1f} ms")
    features = target.forward(torch.tensor([prompt]), None, layers).features

    def draft():
        proposer.start(prompt, features)
        proposer.propose(prompt + [5])
    print(f"drafter propose (block 16, LM head over 15): {median_ms(draft):7.1f} ms")
    hidden = torch.randn(15, target.hidden_size, dtype=proposer.lm_head.weight.dtype)
    with torch.inference_mode():
        print(f"  of which the LM head: {median_ms(lambda: proposer.lm_head(hidden)):7.1f} ms")


if __name__ == "__main__":
    main()
