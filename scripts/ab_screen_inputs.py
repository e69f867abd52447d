"""The integer screen's inputs dense against wide, inside real target passes over real text, in ONE process.

Usage: .venv/bin/python scripts/ab_screen_inputs.py [float32|bfloat16] [CONTEXT] [ROUNDS]
(defaults: bfloat16, 300 tokens of context, 15 rounds; 2 threads; AVX512-VNNI only)

SmolLM2-135M reads CONTEXT tokens of GSM8K test text (questions and reference answers, no chat template), then passes
of 1, 4, 8 and 16 of the text's next tokens run with the head's integer screen (native.c, "the int8 screen in
integers") rounding its inputs dense (every channel in two bytes, int16's precision: the twentieth session's
screen's sums) and wide (all but a row's 8 largest channels in a byte) at every width, alternating (the order
flipping every round). Prints per width the median time of the screen (the greedy tokens from the pass's hidden
states, after the pass evicted the head from the caches), the median per-round ratio wide / dense, the whole pass's
medians, and how many tokens each summed in float32 per row (mean). Both ways' tokens must be equal (checked).
"""

import json
import statistics
import sys
import time

import torch

from dflash.data import data_dir
from dflash.loading import load_target_cached
from dflash.models import native
from dflash.models.screening import ScreenedHead

WIDTHS = (1, 4, 8, 16)


def text_tokens(target, records: int = 12) -> torch.Tensor:
    rows = [json.loads(line) for line in (data_dir() / "gsm8k_test.jsonl").read_text().splitlines()[:records]]
    text = "\n\n".join(" ".join(str(value) for value in row.values()) for row in rows)
    return torch.tensor(target.tokenizer(text)["input_ids"])


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv else "bfloat16"
    context = int(argv[1]) if len(argv) > 1 else 300
    rounds = int(argv[2]) if len(argv) > 2 else 15
    if not native.int8_vnni():
        sys.exit("no AVX512-VNNI here: the int8 screen sums in float32")
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    target.screen_greedy, target.screen_kind = True, "int8"
    native.set_screen_wide(True)
    heads = {"dense": ScreenedHead(target.engine.lm_head.weight, "int8"),
             "wide": ScreenedHead(target.engine.lm_head.weight, "int8")}
    heads["dense"].wide_from, heads["wide"].wide_from = 10**9, 1
    chosen = {"head": None}
    target.engine.screen = lambda kind: chosen["head"]  # the engine's greedy tokens through the head of the turn
    tokens = text_tokens(target)
    cache = target.new_cache(capacity=context + max(WIDTHS) + 1)
    target.forward(tokens[None, :context], cache)
    screen = {(w, h): [] for w in WIDTHS for h in heads}
    whole = {(w, h): [] for w in WIDTHS for h in heads}
    summed = {(w, h): [] for w in WIDTHS for h in heads}
    for turn in range(rounds):
        for width in WIDTHS:
            found = {}
            for label in heads if turn % 2 else reversed(list(heads)):
                chosen["head"] = heads[label]
                started = time.perf_counter()
                out = target.forward(tokens[None, context:context + width], cache, (), logits_at="hidden")
                middle = time.perf_counter()
                found[label] = target.greedy_of(out.hidden[0]).tolist()
                ended = time.perf_counter()
                cache.truncate(context)
                screen[(width, label)].append(ended - middle)
                whole[(width, label)].append(ended - started)
                summed[(width, label)].append(heads[label].last_screened.float().mean().item())
            if found["dense"] != found["wide"]:
                sys.exit(f"width {width}: the two screens' tokens differ")
    print(f"{dtype}, {context} tokens of context, {rounds} rounds, 2 threads ({native.build_id()})")
    for width in WIDTHS:
        ms = {h: 1000 * statistics.median(screen[(width, h)]) for h in heads}
        ratio = statistics.median(b / a for a, b in zip(screen[(width, "dense")], screen[(width, "wide")]))
        passes = {h: 1000 * statistics.median(whole[(width, h)]) for h in heads}
        sums = {h: statistics.mean(summed[(width, h)]) for h in heads}
        print(f"width {width:2d}: screen dense {ms['dense']:.2f} ms, wide {ms['wide']:.2f} ms (wide/dense "
              f"{ratio:.2f}); pass and screen {passes['dense']:.2f} / {passes['wide']:.2f} ms; float32 sums a row "
              f"{sums['dense']:.1f} / {sums['wide']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
