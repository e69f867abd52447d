"""The garbage collector's passes while generating right after loading, with and without loading.settle_heap.

Usage: .venv/bin/python scripts/gc_after_loading.py [--settle] [--dtype float32|bfloat16] [--method M]
(defaults: no settling, float32, dflash+ngram; 2 threads; 6 generations of 128 tokens after a 16-token warm-up)

Why: a full pass over what loading leaves (~380,000 objects with SmolLM2) took 170-220 ms; whether one runs inside
the generations is what settle_heap is for. Prints each generation's count of passes and their milliseconds.
"""

import argparse
import gc
import time

import torch

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached, settle_heap

PROMPTS = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
           "clips did Natalia sell altogether in April and May?",
           "Write a Python function that checks whether a string is a palindrome.",
           "Explain the difference between a list and a tuple in Python.")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settle", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--method", default="dflash+ngram")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", args.dtype)
    decoder = SpeculativeDecoder(target, build_proposer(args.method, target)[0])
    decoder.generate(target.encode_prompt(PROMPTS[0], chat=True), GenerationConfig(max_new_tokens=16))
    if args.settle:
        settle_heap()
    passes, started = [], {}

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started["at"] = time.perf_counter()
        else:
            passes.append((info["generation"], 1000 * (time.perf_counter() - started["at"])))

    gc.callbacks.append(watch)
    for prompt in PROMPTS * 2:
        passes.clear()
        tokens = decoder.generate(target.encode_prompt(prompt, chat=True), GenerationConfig(max_new_tokens=128)).tokens
        full = [ms for generation, ms in passes if generation == 2]
        print(f"{len(tokens)} tokens: {len(passes)} passes, {sum(ms for _, ms in passes):.1f} ms; full passes: "
              f"{len(full)}, {' '.join(f'{ms:.0f} ms' for ms in full) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
