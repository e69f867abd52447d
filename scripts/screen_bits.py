"""How many tokens survive the LM head's screen at each precision: the screen's provable bound, half a quantisation
step times |x|_1 for a token's row (per row, or per group of columns), against real hidden states.

Usage: .venv/bin/python scripts/screen_bits.py   (SmolLM2 in float32; 4 GSM8K and 3 MT-Bench texts, 300 tokens at
most each; run from the repository root: ../shared/data)

Why: a two-stage screen (int4 first, then int8 for its survivors) would read half the bytes of a step's int8 screen,
if few tokens survived the int4 stage (thirty-second session: they all do).
"""

import json

import torch

from dflash.loading import load_target_cached


def survivors(x: torch.Tensor, weight: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    """Per row of x: the tokens whose bounded logit may still be the largest."""
    top = 2 ** (bits - 1) - 1
    rows = weight.view(weight.shape[0], -1, group or weight.shape[1])
    scale = rows.abs().amax(2, keepdim=True) / top
    approx = x @ ((rows / scale).round().clamp(-top - 1, top) * scale).view_as(weight).T
    bound = 0.5 * x.abs().view(x.shape[0], rows.shape[1], -1).sum(2) @ scale.squeeze(2).T
    floor = (approx - bound).max(1, keepdim=True).values
    return (approx + bound >= floor).sum(1).float()


def main() -> int:
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "float32")
    weight = target.model.lm_head.weight.detach().float()
    rows = [json.loads(line) for line in open("../shared/data/gsm8k_test.jsonl")][:4]
    rows += [json.loads(line) for line in open("../shared/data/mt_bench.jsonl")][:3]
    states = []
    for row in rows:
        text = (row.get("prompt") or row["turns"][0]) + "\n" + row.get("answer", "")
        ids = target.tokenizer(text, return_tensors="pt")["input_ids"][:, :300]
        with torch.no_grad():
            states.append(target.model.model(ids).last_hidden_state[0])
    x = torch.cat(states)
    print(f"{x.shape[0]} hidden states, {weight.shape[0]} tokens")
    for bits, group in [(8, None), (6, None), (5, None), (4, None), (4, 64), (4, 32)]:
        kept = survivors(x, weight, bits, group)
        print(f"int{bits} {'per token' if group is None else f'groups of {group}'}: survivors median "
              f"{kept.median():.0f}, mean {kept.mean():.1f}, 90th percentile {kept.quantile(0.9):.0f}, most "
              f"{kept.max():.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
