"""Predicted Outputs (prediction.py) on real prompts: each prompt's answer timed with no prediction, with the exact
answer as its prediction (a client that knows it, e.g. re-asking), and with an edited one (every fourth line of the
answer changed, a client whose guess is three quarters right), beside plain `ar`; all in one process, interleaved
prompt by prompt, the median of REPEATS runs each. Every output is checked to be the same as without a prediction.

Usage: .venv/bin/python scripts/prediction_bench.py [DATASET] [N] [MAX_TOKENS] [OUT_DIR]
       (defaults: humaneval 8 192 runs/prediction_bench; DATASET a file name in ../shared/data without .jsonl's
       split, as dflash bench names them: humaneval, gsm8k, mt_bench)
Prints a table (tokens/s, speedup over `ar`, the prediction's drafts accepted and rejected) and writes
OUT_DIR/prediction_bench_DATASET.json.
"""

import json
import platform
import statistics
import sys
import time
from pathlib import Path

from dflash.llm import LLM

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
FILES = {"humaneval": "humaneval.jsonl", "gsm8k": "gsm8k_test.jsonl", "mt_bench": "mt_bench.jsonl"}
REPEATS = 3
SCENARIOS = ("ar", "no prediction", "exact prediction", "edited prediction")
PREDICTED = SCENARIOS[2:]


def prompts_of(dataset: str, count: int) -> list[str]:
    rows = [json.loads(line) for line in (DATA / FILES[dataset]).read_text().splitlines()[:count]]
    return [row.get("prompt") or row["turns"][0] for row in rows]


def edited(text: str) -> str:
    """The text with every fourth line changed (upper-cased, so its tokens differ)."""
    lines = text.split("\n")
    return "\n".join(line.upper() if k % 4 == 2 else line for k, line in enumerate(lines))


def main() -> None:
    dataset = sys.argv[1] if len(sys.argv) > 1 else "humaneval"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 192
    folder = Path(sys.argv[4] if len(sys.argv) > 4 else "runs/prediction_bench")
    folder.mkdir(parents=True, exist_ok=True)
    plain, drafting = LLM("smollm2-135m", method="ar"), LLM("smollm2-135m")
    tokens = {scenario: 0 for scenario in SCENARIOS}
    seconds = {scenario: 0.0 for scenario in SCENARIOS}
    accepted = {scenario: 0 for scenario in SCENARIOS}
    rejected = {scenario: 0 for scenario in SCENARIOS}
    same = 0
    for prompt in prompts_of(dataset, count):
        messages = [{"role": "user", "content": prompt}]
        answer = drafting.chat(messages, max_tokens)  # also a warm-up of this prompt's path
        runs = {"ar": (plain, None), "no prediction": (drafting, None), "exact prediction": (drafting, answer.text),
                "edited prediction": (drafting, edited(answer.text))}
        times, last = {scenario: [] for scenario in SCENARIOS}, {}
        for _ in range(REPEATS):
            for scenario, (llm, prediction) in runs.items():
                started = time.perf_counter()
                last[scenario] = llm.chat(messages, max_tokens, prediction=prediction)
                times[scenario].append(time.perf_counter() - started)
                same += last[scenario].tokens == answer.tokens
        for scenario in SCENARIOS:
            tokens[scenario] += len(answer.tokens)
            seconds[scenario] += statistics.median(times[scenario])
            accepted[scenario] += last[scenario].stats.prediction_accepted
            rejected[scenario] += last[scenario].stats.prediction_rejected
    rate = {scenario: tokens[scenario] / seconds[scenario] for scenario in SCENARIOS}
    print(f"| {dataset} ({count} prompts, {max_tokens} tokens) | tokens/s | speedup over ar | prediction's drafts "
          "accepted / rejected |\n|---|---:|---:|---:|")
    for scenario in SCENARIOS:
        counts = f"{accepted[scenario]} / {rejected[scenario]}" if scenario in PREDICTED else "-"
        print(f"| {scenario} | {rate[scenario]:.1f} | {rate[scenario] / rate['ar']:.2f}x | {counts} |")
    total = count * REPEATS * len(SCENARIOS)
    print(f"outputs the same as without a prediction: {same} of {total}")
    (folder / f"prediction_bench_{dataset}.json").write_text(json.dumps({
        "dataset": dataset, "prompts": count, "max_tokens": max_tokens, "repeats": REPEATS,
        "tokens_per_s": rate, "accepted": accepted, "rejected": rejected, "same_outputs": same, "runs": total,
        "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["scripts/prediction_bench.py", *sys.argv[1:]])}, indent=1))


if __name__ == "__main__":
    main()
