"""What the text of a growing generation costs a round: decoding the whole output (before the sixty-fifth session)
against GrowingText (detokenize.py), interleaved in one process, on SmolLM2's tokenizer.

Usage: .venv/bin/python scripts/time_growing_text.py [TOKENS_PER_ROUND] [REPEATS]

The output is HumanEval's prompts, tokenized and joined (code: short tokens, many newlines), grown by
TOKENS_PER_ROUND (default 2, about a DFlash round's) up to 4,096 tokens. Each round asks for the text once, as the
engine's stop-string check and a streamed reply each do. Printed: the text's total cost over a generation of each
length, and a round's near its end (the mean over its last 64 tokens).
"""

import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from dflash.detokenize import GrowingText, byte_tokens
from dflash.hub import resolve_registry_folder

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = (512, 1024, 2048, 4096)


def tokens(tokenizer, count: int) -> list[int]:
    rows = (ROOT.parent / "shared/data/humaneval.jsonl").read_text().splitlines()
    ids = tokenizer.encode("\n".join(json.loads(row)["prompt"] for row in rows))
    return ids[:count]


def generation(text_of, ids: list[int], step: int) -> tuple[float, float]:
    """(seconds for the text at every round, the mean seconds a round over the last 64 tokens: GrowingText moves
    its settled point, decoding the whole text, once in them)."""
    seconds = []
    for length in range(step, len(ids) + 1, step):
        start = time.perf_counter()
        text_of(ids[:length])
        seconds.append(time.perf_counter() - start)
    end = seconds[-max(1, 64 // step):]
    return sum(seconds), sum(end) / len(end)


def main() -> None:
    step = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    tokenizer = AutoTokenizer.from_pretrained(resolve_registry_folder("smollm2-135m"))
    ids = tokens(tokenizer, max(LENGTHS))
    print(f"SmolLM2-135M-Instruct's tokenizer, {step} tokens a round, best of {repeats} interleaved runs\n")
    print("| tokens | whole decode: a generation | GrowingText | whole: a round at the end | GrowingText |")
    print("|---:|---:|---:|---:|---:|")
    for length in LENGTHS:
        whole, growing = [], []
        for _ in range(repeats):
            whole.append(generation(lambda part: tokenizer.decode(part), ids[:length], step))
            growing.append(generation(GrowingText(tokenizer.decode, byte_tokens(tokenizer)), ids[:length], step))
        (w_total, w_last), (g_total, g_last) = min(whole), min(growing)
        print(f"| {length} | {w_total * 1e3:.0f} ms | {g_total * 1e3:.0f} ms | {w_last * 1e6:.0f} us "
              f"| {g_last * 1e6:.0f} us |")


if __name__ == "__main__":
    main()
