"""What the masks of patterned JSON strings cost (formats and patterns: grammar_masks.FORMATTED), new state by new
state along grammar_masks.FORMATTED_DOCUMENT, with a fresh vocabulary each repetition and the tokens' table split
made first (once per tokenizer in a server, timed apart). The first repetition also builds the grammar's tables.

Usage: .venv/bin/python scripts/pattern_masks.py [NAME] [REPEATS]   (default: smollm2-135m 3)
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dflash.structured as structured  # noqa: E402
from grammar_masks import FORMATTED, FORMATTED_DOCUMENT  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from dflash.grammar import STRING, compile_schema  # noqa: E402
from dflash.hub import converted_dir  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    tokenizer = AutoTokenizer.from_pretrained(converted_dir(name))
    pieces = structured.token_pieces(tokenizer, len(tokenizer))
    document = FORMATTED_DOCUMENT.encode()
    for repeat in range(repeats):
        vocabulary = structured.JsonVocabulary(pieces)
        started = time.perf_counter()
        vocabulary.ascii_split = structured._ascii_split(vocabulary.all_keys, vocabulary.all_ids)
        split = 1000 * (time.perf_counter() - started)
        grammar, times, patterned = compile_schema(FORMATTED), [], []
        state = grammar.initial
        for byte in document:
            if (grammar.key, state) not in vocabulary.masks:
                started = time.perf_counter()
                vocabulary.allowed(grammar, state)
                times.append(1000 * (time.perf_counter() - started))
                if state[0] == STRING and state[1] not in (0, 1) and state[1][2] is not None:
                    patterned.append(times[-1])
            state = grammar.feed(state, byte)
        print(f"{name} repeat {repeat}: split {split:.0f} ms; {len(times)} new states, median "
              f"{statistics.median(times):.1f} ms, at most {max(times):.1f}, {sum(times):.0f} in all; "
              f"{len(patterned)} inside patterned strings: at most {max(patterned):.1f} ms, {sum(patterned):.0f} in all")


if __name__ == "__main__":
    main()
