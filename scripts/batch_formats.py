"""The same GSM8K prompts through `dflash batch` twice: as plain rows, and as a file in OpenAI's batch format (each
body through the server's handlers, openai_batch.py); prints each run's own timing line and how many answers are
the same.

Usage: .venv/bin/python scripts/batch_formats.py [N] [MAX_TOKENS] [OUT_DIR]   (defaults: 8 96 runs/batch_formats)
"""

import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k_test.jsonl"
DFLASH = str(Path(sys.executable).parent / "dflash")


def run(source: Path, output: Path, *extra: str) -> str:
    """The run's timing line (its last line on stderr)."""
    output.unlink(missing_ok=True)
    done = subprocess.run([DFLASH, "batch", str(source), "--output", str(output), "--no-progress", *extra],
                          capture_output=True, text=True, check=True)
    return done.stderr.strip().splitlines()[-1]


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    folder = Path(sys.argv[3] if len(sys.argv) > 3 else "runs/batch_formats")
    folder.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[:count]]
    plain, batch = folder / "plain.jsonl", folder / "openai_batch.jsonl"
    plain.write_text("".join(json.dumps({"id": f"q{k}", "prompt": p}) + "\n" for k, p in enumerate(prompts)))
    batch.write_text("".join(json.dumps({
        "custom_id": f"q{k}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                 "temperature": 0}}) + "\n" for k, p in enumerate(prompts)))
    print("plain rows:", run(plain, folder / "plain_out.jsonl", "--max-new-tokens", str(max_tokens)))
    print("OpenAI's batch format:", run(batch, folder / "batch_out.jsonl"))
    texts = {row["id"]: row["text"] for row in map(json.loads, (folder / "plain_out.jsonl").open())}
    answers = {row["custom_id"]: row["response"]["body"]["choices"][0]["message"]["content"]
               for row in map(json.loads, (folder / "batch_out.jsonl").open())}
    print(f"{sum(answers[k] == texts[k] for k in texts)} of {len(texts)} answers the same")


if __name__ == "__main__":
    main()
