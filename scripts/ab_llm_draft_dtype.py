"""LLM's drafting precision, the target's dtype against --draft-dtype auto's choice (timed for one sequence), on the
same GSM8K prompts in one process, the two LLMs taking turns: a batch of them at once, or (`single`) one at a time.

    .venv/bin/python scripts/ab_llm_draft_dtype.py [single] [--prompts N] [--runs R]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from dflash import LLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="batch", choices=["batch", "single"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_test.jsonl"
    prompts = [json.loads(line)["prompt"] for line in data.open()][: args.prompts]
    llms = {"target's dtype": LLM("smollm2-135m", draft_dtype=None), "auto": LLM("smollm2-135m", draft_dtype="auto")}
    for name, llm in llms.items():
        print(f"{name}: the drafter runs in {llm.proposer.report.get('draft_dtype')}")
        llm.generate(prompts[0], max_new_tokens=16)  # warm
    speeds, outputs = {name: [] for name in llms}, {}
    for run in range(args.runs):
        order = list(llms.items()) if run % 2 == 0 else list(llms.items())[::-1]
        for name, llm in order:
            start = time.perf_counter()
            if args.mode == "single":
                results = [llm.generate(p, max_new_tokens=args.max_new_tokens) for p in prompts]
            else:
                results = llm.generate(prompts, max_new_tokens=args.max_new_tokens)
            speeds[name].append(sum(len(r.tokens) for r in results) / (time.perf_counter() - start))
            outputs.setdefault(name, [r.tokens for r in results])
    for name, runs in speeds.items():
        print(f"{name}: median {statistics.median(runs):.1f} tok/s over {args.runs} runs {[round(s, 1) for s in runs]}")
    print("outputs identical:", len({json.dumps(o) for o in outputs.values()}) == 1)


if __name__ == "__main__":
    main()
