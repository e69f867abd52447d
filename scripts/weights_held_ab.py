"""A generation's weights checked at its first pass only (TargetModel.weights_held, the engine's run) against at
every pass, whole generations interleaved in one process.

Usage: .venv/bin/python scripts/weights_held_ab.py [DTYPE] [DATASET] [PROMPTS] [REPEATS]
(defaults: bfloat16, mt_bench, 4, 3; methods ar and dflash+ngram, 128 new tokens, greedy, 2 threads; run from the
repository root: ../shared/data). Prints each method's time per token held / every pass, median (range).
"""

import contextlib
import statistics
import sys
import time

from dflash.engine import SpeculativeDecoder
from dflash.loading import build_proposer, settle_heap
from dflash.methods.base import MethodOptions
from paired import generation_setup
from dflash.models.target import TargetModel


@contextlib.contextmanager
def every_pass(target):
    yield


def main(argv: list[str]) -> int:
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
