"""What a batched round costs against what the controller's cost model prices it at: 8 GSM8K prompts (their first
turn) decoded together through one engine, each round the cost model reads logged by its width (rows x tokens),
its median beside the model's price at the end.

    .venv/bin/python scripts/batch_round_costs.py [METHOD] [ROWS] [NEW_TOKENS]   (default: dflash+ngram 8 64)
"""

import collections
import statistics
import sys

from dflash import control
from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import Engine, GenerationConfig
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions


def main(argv: list[str]) -> None:
    method = argv[0] if argv else "dflash+ngram"
    rows = int(argv[1]) if len(argv) > 1 else 8
    new_tokens = int(argv[2]) if len(argv) > 2 else 64
    target = load_target_cached("smollm2-135m", release_plain=True)
    path, template = resolve_dataset("gsm8k")
    prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, rows)]
    proposer, _ = build_proposer(method, target, MethodOptions(draft_dtype="auto"))
    seen = collections.defaultdict(list)
    observe_round = control.CostModel.observe_round

    def logged(costs, width, seconds, context, drafting):
        seen[width].append(seconds)
        return observe_round(costs, width, seconds, context, drafting)

    control.CostModel.observe_round = logged
    for run in range(2):  # the first warms up
        seen.clear()
        engine = Engine(target, proposer, max_batch=rows)
        for ids in prompts:
            engine.submit(ids, GenerationConfig(max_new_tokens=new_tokens))
        engine.run()
    print(f"{method}, {rows} rows, {new_tokens} new tokens; a 1-token pass priced {1000 * engine.costs.level:.1f} ms")
    for width in sorted(seen):
        print(f"width {width}: {len(seen[width])} rounds read, median {1000 * statistics.median(seen[width]):.1f} ms, "
              f"priced {1000 * engine.costs.cost(width):.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
