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

import torch

from dflash import control
from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached, settle_heap
from dflash.methods.base import MethodOptions


def never_draft(controller, alternative: float = 0.0) -> bool:
    controller.stats.skipped_drafting += 1
    return False


def main(argv: list[str]) -> int:
    dtype, dataset, count, repeats = (argv + ["bfloat16", "mt_bench", "4", "3"][len(argv):])[:4]
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    path, template = resolve_dataset(dataset)
    prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, int(count))]
    config = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    ar = SpeculativeDecoder(target, build_proposer("ar", target, MethodOptions())[0])
    drafted = SpeculativeDecoder(target, build_proposer("dflash", target, MethodOptions(draft_dtype=dtype))[0])
    ar.generate(prompts[0], config), drafted.generate(prompts[0], config)
    settle_heap()
    adaptive = control.DraftController.should_draft
    ratios = {"dflash": [], "dflash, drafting off": []}
    for _ in range(int(repeats)):
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
