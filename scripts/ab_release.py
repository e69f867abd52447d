"""Generation time with the target's plain weights released against kept, alternated in one process.

Usage: .venv/bin/python scripts/ab_release.py [float32|bfloat16|int8] [PAIRS]

`ar` and `dflash+ngram` on one GSM8K-style prompt, 96 new tokens, each pair timing both states in an order that flips
every pair (TargetModel.release_plain_weights / restore_plain_weights). Prints the median ratio released/kept, the
range, and whether the outputs were the same.
"""

import statistics
import sys
import time

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached, settle_heap
from dflash.methods.base import MethodOptions

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May?")


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    target = load_target_cached("smollm2-135m", dtype=dtype)
    proposer, _ = build_proposer("dflash+ngram", target, MethodOptions(draft_dtype="auto"))
    settle_heap()
    prompt = target.encode_prompt(PROMPT)
    config = GenerationConfig(max_new_tokens=96)
    decoders = {"ar": SpeculativeDecoder(target), "dflash+ngram": SpeculativeDecoder(target, proposer)}
    for decoder in decoders.values():
        decoder.generate(prompt, GenerationConfig(max_new_tokens=8))
    ratios = {method: [] for method in decoders}
    outputs = {}
    for pair in range(pairs):
        for method, decoder in decoders.items():
            seconds = {}
            for state in ("released", "kept") if pair % 2 else ("kept", "released"):
                target.release_plain_weights() if state == "released" else target.restore_plain_weights()
                start = time.perf_counter()
                tokens = decoder.generate(prompt, config).tokens
                seconds[state] = time.perf_counter() - start
                outputs.setdefault((method, state), tokens)
            ratios[method].append(seconds["released"] / seconds["kept"])
    for method, r in ratios.items():
        same = outputs[(method, "released")] == outputs[(method, "kept")]
        print(f"{dtype} {method}: released/kept time {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}), "
              f"outputs {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
