"""A batch of sequences through the engine with the cost model's batch pricing (`CostModel.seed_batches`: wide
passes priced by their tokens; `DraftController.no_draft_can_pay`: no drafting where no draft could pay) against
without, interleaved in one process: seconds for the whole batch, and the passes' widths.

Usage: .venv/bin/python scripts/batch_pricing_ab.py [METHODS] [ROWS] [NEW_TOKENS] [REPEATS]
(defaults: ar,ngram,dflash+ngram; 16 rows; 32 new tokens; 3 repeats; float32 SmolLM2-135M, greedy, 2 threads)
"""

import statistics
import sys

import torch
from batch_methods import run_batch  # scripts/ is on the path when a script runs from it

from dflash.control import CostModel, DraftController
from dflash.engine import GenerationConfig
from dflash.loading import build_proposer, load_target_cached


def main(argv: list[str]) -> int:
    methods = (argv[0] if argv else "ar,ngram,dflash+ngram").split(",")
    rows = int(argv[1]) if len(argv) > 1 else 16
    new_tokens = int(argv[2]) if len(argv) > 2 else 32
    repeats = int(argv[3]) if len(argv) > 3 else 3
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "float32")
    prompts = [target.encode_prompt(f"Tell me about topic number {i} in a few words, please.") for i in range(rows)]
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    proposers = {m: build_proposer(m, target)[0] for m in methods}
    seed_batches, no_draft_can_pay = CostModel.seed_batches, DraftController.no_draft_can_pay
    times = {(m, v): [] for m in methods for v in ("without", "with")}
    widths = {}
    for repeat in range(repeats + 1):  # the first round warms up
        for method in methods:
            outputs = []
            for variant in ("without", "with") if repeat % 2 else ("with", "without"):
                if variant == "without":
                    CostModel.seed_batches = lambda self, tokens: None
                    DraftController.no_draft_can_pay = lambda self: False
                try:
                    seconds, _, passes, tokens = run_batch(target, proposers[method], prompts, config)
                finally:
                    CostModel.seed_batches, DraftController.no_draft_can_pay = seed_batches, no_draft_can_pay
                outputs.append(tokens)
                if repeat:
                    times[method, variant].append(seconds)
                    widths[method, variant] = passes
            assert outputs[0] == outputs[1], "the pricing changed an output"
    print(f"{rows} rows x {new_tokens} new tokens, medians of {repeats}, outputs identical:")
    for method in methods:
        without, with_ = (statistics.median(times[method, v]) for v in ("without", "with"))
        wide = {v: sorted(set(widths[method, v])) for v in ("without", "with")}
        print(f"{method:14s} without {without:5.2f} s  with {with_:5.2f} s  ({with_ / without:.3f})  "
              f"pass widths without {wide['without']} with {wide['with']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
