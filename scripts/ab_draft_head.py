"""A DFlash drafting pass with its LM head on each kernel, alternating in ONE process (milliseconds, medians).

Usage: .venv/bin/python scripts/ab_draft_head.py [TARGET_DTYPE] [DRAFT_DTYPE] [--all] [--tau DATASET N]
       (defaults: float32 target, bfloat16 drafter; 2 threads)

Each round runs a target step (whose weights evict the drafter's from the caches, as in a round), then one drafting
pass with the head on oneDNN's packed kernel, our float kernel ("native") or int8 rows through our VNNI kernel
("vnni"), in turn, the order rotating every round; 60 rounds after 5 of warm-up. The pass reads its first 4
positions (FIRST_READ), as an adaptive round whose controller wants no more does, or all 15 with --all. Prints each
kernel's median and its median ratio to packed's. With --tau, instead: tau of `dflash:whole` (every draft verified,
greedy, 128 tokens) over the first N prompts of DATASET with the head on each kernel, which is what an inexact
(int8) head could change.
"""

import sys
import time

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions

ROUNDS, WARMUP = 60, 5


def whole_block_tau(target, proposer, kernels: list[str], dataset: str, limit: int) -> None:
    path, template = resolve_dataset(dataset)
    prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, limit)]
    decoder = SpeculativeDecoder(target, proposer, adaptive=False)
    for kernel in kernels:
        proposer.lm_head._kernel_by_bucket = (kernel,) * 3
        results = [decoder.generate(ids, GenerationConfig(max_new_tokens=128)) for ids in prompts]
        tokens, rounds = sum(len(r.tokens) for r in results), sum(r.stats.num_rounds for r in results)
        print(f"{dataset}, {len(prompts)} prompts, head {kernel:6s}: tau {tokens / rounds:.3f}")


def main(argv: list[str]) -> int:
    tau = argv[argv.index("--tau") + 1: argv.index("--tau") + 3] if "--tau" in argv else None
    args = [a for a in argv if not a.startswith("--") and a not in (tau or [])]
    target_dtype, draft_dtype = (args + ["float32", "bfloat16"][len(args):])[:2]
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", target_dtype)
    proposer = build_proposer("dflash", target, MethodOptions(draft_dtype=draft_dtype))[0]
    head = proposer.lm_head
    kernels = ["packed", "native"] + (["vnni"] if head.has_vnni() else [])
    head.packed(), head.native_tiles(), head.vnni()  # every form made once: the kernels are switched, not re-planned
    if tau:
        whole_block_tau(target, proposer, kernels, tau[0], int(tau[1]))
        return 0
    prompt = target.encode_prompt("Janet's ducks lay 16 eggs per day. How much does she make every day?")
    features = target.forward(torch.tensor([prompt]), None, proposer.feature_layers).features
    cache = target.new_cache(capacity=512)
    target.forward(torch.arange(5, 205)[None], cache)
    keep_going = None if "--all" in argv else (lambda confidence: False)
    seconds = {k: [] for k in kernels}
    sequence = None
    for round_ in range(ROUNDS + WARMUP):
        if sequence is None or len(sequence) > 400:
            proposer.start(prompt, features)
            sequence = prompt + [5]
        order = kernels[round_ % len(kernels):] + kernels[:round_ % len(kernels)]
        for kernel in order:
            head._kernel_by_bucket = (kernel,) * 3
            target.forward(torch.tensor([[5]]), cache)
            cache.truncate(200)
            start = time.perf_counter()
            proposer.propose(sequence, keep_going=keep_going)
            if round_ >= WARMUP:
                seconds[kernel].append(time.perf_counter() - start)
            proposer.commit([5, 7], features[:, -2:])
            sequence += [5, 7]
    print(f"{target_dtype} target, {draft_dtype} drafter, reading {'all' if keep_going is None else 'the first 4'}:")
    for kernel in kernels:
        ratios = sorted(t / p for t, p in zip(seconds[kernel], seconds["packed"]))
        print(f"  head {kernel:6s} {1000 * sorted(seconds[kernel])[ROUNDS // 2]:.2f} ms, "
              f"{ratios[ROUNDS // 2]:.3f}x packed's")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
