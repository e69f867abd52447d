"""Build the continuation table shipped for a target from its committed corpus (methods/continuations.py).

Usage: .venv/bin/python scripts/build_continuations.py [CORPUS] [TARGET]
(defaults: corpus/smollm2-135m, smollm2-135m; writes src/dflash/drafters/TARGET-continuations/)

Only the responses count (the target's own tokens, from each record's loss_start): the prompts are the users'.
"""

import sys
import time
from pathlib import Path

from dflash.corpus import read_packed
from dflash.methods.base import SHIPPED_DRAFTERS
from dflash.methods.continuations import MIN_COUNT, MIN_SHARE, ContinuationTable
from dflash.loading import load_target_cached


def main(argv: list[str]) -> int:
    corpus = Path(argv[0] if argv else "corpus/smollm2-135m")
    name = argv[1] if len(argv) > 1 else "smollm2-135m"
    started = time.time()
    records = read_packed(corpus)
    responses = [r["input_ids"][r["loss_start"]:] for r in records]
    table = ContinuationTable.build(responses, vocab_size=load_target_cached(name, "float32").vocab_size)
    folder = SHIPPED_DRAFTERS / f"{name}-continuations"
    table.save(folder, {"corpus": str(corpus), "records": len(records), "response_tokens": sum(map(len, responses)),
                        "min_count": MIN_COUNT, "min_share": MIN_SHARE})
    print(f"{len(table)} continuations from {len(records)} responses in {time.time() - started:.1f} s -> {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
