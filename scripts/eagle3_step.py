"""EAGLE-3's draft step in C (HiddenHalf) against its torch step, interleaved in one process.

Usage: .venv/bin/python scripts/eagle3_step.py step [DTYPE]       the decoder layer of one draft step after a target
                                                                   step, and the head and pick after it (medians of
                                                                   200 each way, ms)
       .venv/bin/python scripts/eagle3_step.py generate [DTYPE]   time per token of `eagle3` on 4 GSM8K prompts x 3,
                                                                   96 tokens, C over torch (median ratio), same outputs
       .venv/bin/python scripts/eagle3_step.py error              a bfloat16 step of 3 pairs, C and torch, against the
                                                                   same step in float32 (largest difference)
       .venv/bin/python scripts/eagle3_step.py tree [DTYPE]       as generate, `eagle3:tree15`: a dynamic tree's depth
                                                                   passes in C against torch's (chain steps in C both)
(DTYPE: the target's and the head's, default bfloat16; 2 threads; run from the repository root: ../shared/data)
"""

import json
import statistics
import sys
import time

import torch

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached, settle_heap
from dflash.methods.base import MethodOptions
from dflash.methods.eagle3.head import Eagle3Head


def step_costs(target, head) -> None:
    half = head.__dict__["_hidden_half"]
    cache = head.new_cache(256)
    cache.reserve(64)
    hidden = torch.randn(1, 1, target.hidden_size).to(head.fc.weight.dtype)
    embeds = target.embed_tokens(torch.tensor([[5]]))
    target_cache = target.new_cache(capacity=400)
    target.forward(torch.arange(5, 305)[None] % 1000, target_cache)
    times = {way: ([], []) for way in ("c", "torch")}
    with torch.inference_mode():
        for i in range(400):
            way = "c" if i % 2 else "torch"
            head.__dict__["_hidden_half"] = half if way == "c" else None
            target.forward(torch.tensor([[7]]), target_cache)  # evicts the head's weights, as in a round
            target_cache.truncate(300)
            started = time.perf_counter()
            out = head.step(embeds, hidden, 10 + i % 8, cache)
            middle = time.perf_counter()
            confidence, index = head.logits(out).float().softmax(-1).max(-1)
            int(index)
            times[way][0].append(middle - started)
            times[way][1].append(time.perf_counter() - middle)
    head.__dict__["_hidden_half"] = half
    for way, (layer, pick) in times.items():
        print(f"{way}: layer {1e3 * statistics.median(layer):.3f} ms, head and pick {1e3 * statistics.median(pick):.3f} ms")


def generation(target, proposer, tree_only: bool = False) -> None:
    head = proposer.head
    half = head.__dict__["_hidden_half"]

    def use_c(on: bool) -> None:
        if not tree_only:
            head.__dict__["_hidden_half"] = half if on else None
        elif on:
            head.__dict__.pop("_native_step", None)
        else:  # the tree's depths through torch's layers, its chain steps in C
            head.__dict__["_native_step"] = lambda *args, tree=None: None if tree else Eagle3Head._native_step(
                head, *args)

    rows = [json.loads(line) for line in open("../shared/data/gsm8k_test.jsonl")][:4]
    prompts = [target.encode_prompt(row["prompt"]) for row in rows]
    config = GenerationConfig(max_new_tokens=96)
    decoder = SpeculativeDecoder(target, proposer)
    decoder.generate(prompts[0], config)
    settle_heap()
    ratios, same = [], True
    for repeat in range(3):
        for i, prompt in enumerate(prompts):
            seconds, tokens = {}, {}
            for way in ("c", "torch") if (repeat + i) % 2 else ("torch", "c"):
                use_c(way == "c")
                started = time.perf_counter()
                result = decoder.generate(prompt, config)
                seconds[way] = (time.perf_counter() - started) / len(result.tokens)
                tokens[way] = result.tokens
            same &= tokens["c"] == tokens["torch"]
            ratios.append(seconds["c"] / seconds["torch"])
    use_c(True)
    print(f"time per token, C step / torch step: median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}), same outputs: {same}")


def step_error(target, head) -> None:
    """The bfloat16 head's step, C and torch, against the shipped head's torch step in float32 (not frozen), on the
    same inputs."""
    from dflash.methods.base import shipped_drafter

    reference = Eagle3Head.load(shipped_drafter(target.name, "eagle3")).eval()
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 3, target.hidden_size, generator=generator) * 4
    embeds = target.embed_tokens(torch.tensor([[9, 14, 3]])).float()

    def run(model, dtype, in_c: bool) -> torch.Tensor:
        half = model.__dict__.get("_hidden_half")
        model.__dict__["_hidden_half"] = half if in_c else None
        cache = model.new_cache(64)
        cache.reserve(40)
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=torch.Generator().manual_seed(2)))
        cache.values.copy_(torch.randn(cache.values.shape, generator=torch.Generator().manual_seed(3)))
        cache.advance(30)
        with torch.inference_mode():
            out = model.step(embeds.to(dtype), hidden.to(dtype), 30, cache).float()
        model.__dict__["_hidden_half"] = half
        return out

    exact = run(reference, torch.float32, False)
    for way, in_c in (("C", True), ("torch", False)):
        difference = (run(head, torch.bfloat16, in_c) - exact).abs()
        print(f"{way} bfloat16 step against float32: largest difference {difference.max():.4f}, mean "
              f"{difference.mean():.4f} (largest value {exact.abs().max():.2f})")


def main(argv: list[str]) -> int:
    mode, dtype = (argv + ["step", "bfloat16"][len(argv):])[:2]
    dtype = "bfloat16" if mode == "error" else dtype
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    options = MethodOptions(draft_dtype=dtype, tree=15 if mode == "tree" else None)
    proposer = build_proposer("eagle3", target, options)[0]
    if proposer.head.__dict__.get("_hidden_half") is None:
        print("no C step for this head (its plan's kernels are not ours)")
        return 1
    if mode == "step":
        step_costs(target, proposer.head)
    elif mode == "error":
        step_error(target, proposer.head)
    else:
        generation(target, proposer, tree_only=mode == "tree")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
