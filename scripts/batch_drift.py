"""Do batched requests give their solo outputs on the real model? (float32, greedy)

Each prompt is generated alone with `ar` (the reference), then all of them through one engine with up to BATCH rows
decoded together, for each method; a row whose tokens differ from its solo output is counted as drift, with the
position where it starts. In float32 a row's logits do not depend on the other rows up to summation order, so drift
can only come from near-ties; the tiny-model tests require zero.

Usage: .venv/bin/python scripts/batch_drift.py [--prompts 100] [--batch 16] [--max-new 48] [--methods ar,dflash]
       [--json FILE] [--threads 2]   (prompts: the first ones of GSM8K, HumanEval, MATH-500 and MT-Bench in turn)
"""

import argparse
import json
import time

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import Engine, GenerationConfig
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions


def mixed_prompts(target, count: int) -> list[list[int]]:
    per_set = [read_prompts(*resolve_dataset(name), limit=count) for name in ("gsm8k", "humaneval", "math500",
                                                                               "mt_bench")]
    texts = [p.turns[0] for group in zip(*per_set) for p in group][:count]
    return [target.encode_prompt(t) for t in texts]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def generate_all(target, proposer, prompts, batch: int, max_new: int) -> list[list[int]]:
    engine = Engine(target, proposer, max_batch=batch)
    seqs = [engine.submit(p, GenerationConfig(max_new_tokens=max_new)) for p in prompts]
    engine.run()
    return [s.result.tokens for s in seqs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--methods", default="ar,dflash")
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    count, batch, max_new, methods = a.prompts, a.batch, a.max_new, a.methods.split(",")
    torch.set_num_threads(a.threads)
    target = load_target_cached("smollm2-135m")
    prompts = mixed_prompts(target, count)
    started = time.perf_counter()
    solo = [generate_all(target, build_proposer("ar", target)[0], [p], 1, max_new)[0] for p in prompts]
    report = {"prompts": len(prompts), "batch": batch, "max_new_tokens": max_new,
              "solo_ar_seconds": round(time.perf_counter() - started, 1), "methods": {}}
    for method in methods:
        proposer, _ = build_proposer(method, target, MethodOptions())
        started = time.perf_counter()
        batched = generate_all(target, proposer, prompts, batch, max_new)
        drift = {i: first_difference(a, b) for i, (a, b) in enumerate(zip(solo, batched)) if a != b}
        report["methods"][method] = {"seconds": round(time.perf_counter() - started, 1), "drifted": len(drift),
                                     "first_difference_at": drift}
        print(f"{method}: batched (up to {batch} rows) vs solo ar: {len(drift)} of {len(prompts)} outputs differ"
              + (f" (first differing token at {sorted(drift.values())})" if drift else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
