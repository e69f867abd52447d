"""What attaching a drafter costs a round when it does not draft: `ar` against `dflash` with drafting forced off
(the target's passes then also return the drafter's feature layers, and the proposer takes them) and against
`dflash` as it runs (adaptive), interleaved prompt by prompt in one process.

Usage: .venv/bin/python scripts/drafter_overhead.py [DTYPE] [DATASET] [PROMPTS] [REPEATS]
(defaults: bfloat16, mt_bench, 4, 3; 128 new tokens, greedy, 2 threads; run from the repository root: ../shared/data)
Prints each variant's time per token over `ar`'s, median (range) over the generations.
"""

import statistics
import sys
import time

from dflash import control
from dflash.engine import SpeculativeDecoder
from dflash.loading import build_proposer, settle_heap
from dflash.methods.base import MethodOptions
from paired import generation_setup


def never_draft(controller, alternative: float = 0.0) -> bool:
    controller.stats.skipped_drafting += 1
    return False


def main(argv: list[str]) -> int:
    dtype, target, prompts, config, repeats = generation_setup(argv)
    ar = SpeculativeDecoder(target, build_proposer("ar", target, MethodOptions())[0])
    drafted = SpeculativeDecoder(target, build_proposer("dflash", target, MethodOptions(draft_dtype=dtype))[0])
    ar.generate(prompts[0], config), drafted.generate(prompts[0], config)
    settle_heap()
    adaptive = control.DraftController.should_draft
    ratios = {"dflash": [], "dflash, drafting off": []}
    for _ in range(repeats):
        for prompt in prompts:
            seconds = {}
            for name in ("ar", "dflash", "dflash, drafting off"):
                control.DraftController.should_draft = never_draft if name.endswith("off") else adaptive
                started = time.perf_counter()
                result = (ar if name == "ar" else drafted).generate(prompt, config)
                seconds[name] = (time.perf_counter() - started) / len(result.tokens)
            control.DraftController.should_draft = adaptive
            for name in ratios:
                ratios[name].append(seconds[name] / seconds["ar"])
    for name, values in ratios.items():
        print(f"{name}: time per token / ar {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
