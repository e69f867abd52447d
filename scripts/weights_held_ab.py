"""A generation's weights checked at its first pass only (TargetModel.weights_held, the engine's run) against at
every pass, whole generations interleaved in one process; or (`--pass`) what the check costs one step.

Usage: .venv/bin/python scripts/weights_held_ab.py [DTYPE] [DATASET] [PROMPTS] [REPEATS]
       .venv/bin/python scripts/weights_held_ab.py --pass [DTYPE]
(defaults: bfloat16, mt_bench, 4, 3; methods ar and dflash+ngram, 128 new tokens, greedy, 2 threads; run from the
repository root: ../shared/data). Prints each method's time per token held / every pass, median (range); with
--pass, the median of 300 steps after 300 tokens with the versions read and 300 without, alternating.
"""

import contextlib
import statistics
import sys
import time

import torch

from dflash.engine import SpeculativeDecoder
from dflash.loading import build_proposer, settle_heap
from dflash.methods.base import MethodOptions
from dflash.models.target import TargetModel
from paired import generation_setup


@contextlib.contextmanager
def every_pass(target):
    yield


def step_cost(dtype: str) -> None:
    """One step's layers with the C stack's version check and without (ProductsUnchanged.holds), alternating."""
    from dflash.loading import load_target_cached
    from dflash.models.transformer import ProductsUnchanged

    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    cache = target.new_cache(capacity=400)
    target.forward(torch.arange(5, 305)[None] % 1000, cache)
    holds, seconds = ProductsUnchanged.holds, {True: [], False: []}
    with torch.inference_mode():
        for i in range(600):
            check = i % 2 == 0
            ProductsUnchanged.holds = holds if check else (lambda self, versions=True: True)
            started = time.perf_counter()
            target.forward(torch.tensor([[7]]), cache, (), "hidden" if target.defers_logits else "all")
            seconds[check].append(time.perf_counter() - started)
            cache.truncate(300)
    ProductsUnchanged.holds = holds
    checked, unchecked = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"{dtype} step: {1e3 * checked:.3f} ms with the versions read, {1e3 * unchecked:.3f} without, "
          f"{1e6 * (checked - unchecked):.0f} us")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pass"]:
        step_cost(argv[1] if len(argv) > 1 else "bfloat16")
        return 0
    dtype, target, prompts, config, repeats = generation_setup(argv)
    held = TargetModel.weights_held
    for method in ("ar", "dflash+ngram"):
        decoder = SpeculativeDecoder(target, build_proposer(method, target, MethodOptions(draft_dtype="auto"))[0])
        decoder.generate(prompts[0], config)
        settle_heap()
        ratios = []
        for repeat in range(repeats):
            for i, prompt in enumerate(prompts):
                seconds = {}
                for way in ("held", "every pass") if (repeat + i) % 2 else ("every pass", "held"):
                    TargetModel.weights_held = held if way == "held" else every_pass
                    started = time.perf_counter()
                    result = decoder.generate(prompt, config)
                    seconds[way] = (time.perf_counter() - started) / len(result.tokens)
                ratios.append(seconds["held"] / seconds["every pass"])
        TargetModel.weights_held = held
        print(f"{dtype} {method}: time per token held / every pass {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
