"""Verify rounds whose LM head stops at the first rejected draft (the default on CPU) against rounds that score every
verified position, generation by generation in one process.

Usage: .venv/bin/python scripts/ab_deferred_logits.py [DATASET] [LIMIT] [METHODS] [MAX_NEW]
(defaults: gsm8k, 6 prompts, dflash,dflash:whole,eagle3, 128 new tokens; float32 SmolLM2-135M-Instruct, greedy,
the shipped drafters; the thread count is torch's, so set OMP_NUM_THREADS to fix it)

For every prompt and method, the two variants generate in turn, the order flipping every prompt, each with its own
decoder (its own learnt costs; `TargetModel.defer_logits` is switched around both its construction and its runs).
Prints, per method, the median time per output token of each variant, the median and range of the per-prompt ratio
(stepped / full; below 1: the stepped head is faster), and whether every output was identical; --json FILE writes
the same.
"""

import argparse
import json
import statistics
import sys

import torch

from dflash.bench import parse_method, read_prompts, resolve_dataset
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions

VARIANTS = ("full", "stepped")


def tpot_ms(result) -> float:
    decode = result.stats.total_s - result.stats.ttft_s
    return 1000 * decode / max(1, len(result.tokens) - 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset", nargs="?", default="gsm8k")
    p.add_argument("limit", nargs="?", type=int, default=6)
    p.add_argument("methods", nargs="?", default="dflash,dflash:whole,eagle3")
    p.add_argument("max_new", nargs="?", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    target = load_target_cached("smollm2-135m", "float32")
    path, template = resolve_dataset(args.dataset)
    prompts = [target.encode_prompt(prompt.turns[0]) for prompt in read_prompts(path, template, args.limit)]
    config = GenerationConfig(max_new_tokens=args.max_new, ignore_eos=True)
    decoders = {}
    for method in args.methods.split(","):
        spec = parse_method(method)
        for variant in VARIANTS:
            target.defer_logits = variant == "stepped"
            proposer, _ = build_proposer(spec.name, target, MethodOptions(block_size=spec.size))
            decoders[method, variant] = SpeculativeDecoder(target, proposer, adaptive=not spec.whole_blocks)
    times = {key: [] for key in decoders}
    identical = {method: True for method, _ in decoders}
    for index, ids in enumerate(prompts):
        for method in dict.fromkeys(m for m, _ in decoders):
            outputs = {}
            for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
                target.defer_logits = variant == "stepped"
                result = decoders[method, variant].generate(ids, config)
                times[method, variant].append(tpot_ms(result))
                outputs[variant] = result.tokens
            identical[method] &= outputs["full"] == outputs["stepped"]
            print(f"prompt {index}: {method:14s} " + "  ".join(
                f"{v} {times[method, v][-1]:5.1f} ms" for v in VARIANTS), file=sys.stderr, flush=True)
    report = {"threads": torch.get_num_threads(), "dataset": args.dataset, "prompts": len(prompts), "methods": {}}
    print(f"{'method':14s} {'full ms':>8s} {'stepped ms':>10s}  stepped/full median (range)  identical")
    for method in identical:
        full, stepped = times[method, "full"], times[method, "stepped"]
        ratios = sorted(s / f for s, f in zip(stepped, full))
        row = {"full_tpot_ms": statistics.median(full), "stepped_tpot_ms": statistics.median(stepped),
               "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
               "identical": identical[method]}
        report["methods"][method] = row
        print(f"{method:14s} {row['full_tpot_ms']:8.1f} {row['stepped_tpot_ms']:10.1f}  "
              f"{row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})  {identical[method]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
