"""Several prompts in one /v1/completions request against the same prompts one request after another.

Usage: start `dflash serve --port 8123` (SmolLM2-135M-Instruct, the default), then
.venv/bin/python scripts/batched_prompts.py [URL] [PROMPTS] [MAX_TOKENS]
(default http://127.0.0.1:8123/v1, 8 GSM8K test prompts, 48 tokens). Greedy; the two ways alternate, three times
each; prints each way's median seconds and whether the texts are the same.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import openai

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k_test.jsonl"


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8123/v1"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 48
    client = openai.OpenAI(base_url=url, api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    prompts = [json.loads(line)["prompt"] + "\nAnswer:" for line in DATA.read_text().splitlines()[:count]]
    ways = {"one request": lambda: [c.text for c in client.completions.create(
                model=model, prompt=prompts, max_tokens=max_tokens, temperature=0).choices],
            f"{count} requests": lambda: [client.completions.create(
                model=model, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text for p in prompts]}
    seconds, texts = {way: [] for way in ways}, {}
    for repeat in range(3):
        for way in (list(ways) if repeat % 2 == 0 else list(ways)[::-1]):
            started = time.perf_counter()
            texts[way] = ways[way]()
            seconds[way].append(time.perf_counter() - started)
    for way, runs in seconds.items():
        print(f"{way}: {statistics.median(runs):.2f} s median (runs {', '.join(f'{s:.2f}' for s in runs)})")
    print("same texts:", len({tuple(t) for t in texts.values()}) == 1)


if __name__ == "__main__":
    main()
