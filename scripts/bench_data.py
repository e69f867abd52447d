"""Regeneration speed: `dflash data`'s engine (continuous batching through our forward) against transformers'
batched `generate` (left-padded batches, what the regeneration did before), on the same prompts, alternating.

Usage: .venv/bin/python scripts/bench_data.py [PROMPTS] [BATCH] [MAX_NEW] [THREADS] [ROUNDS]
       (defaults 32 16 256 2 2: GSM8K train, Code Alpaca and ShareGPT first turns, a third each)
Prints response tokens/s of each and their ratio; the outputs are compared too (greedy, float32).
"""

import sys
import time

import torch

from dflash import data
from dflash.loading import load_target_cached


def prompts_mix(target, count: int) -> list[list[int]]:
    third = count // 3
    texts = [p.text for p in data.read_jsonl_prompts(data.resolve_input_path("gsm8k_train.jsonl"), third)]
    texts += [p.text for p in data.read_jsonl_prompts(data.resolve_input_path("code_alpaca_2k.jsonl"), third)]
    try:
        texts += [p.text for p in data.read_sharegpt(4 * count) if p.text.strip()][: count - len(texts)]
    except Exception:  # noqa: BLE001 - without the [data] extra: more GSM8K instead
        texts += [p.text for p in data.read_jsonl_prompts(data.resolve_input_path("gsm8k_train.jsonl"), count)][third:]
    ids = [target.encode_prompt(t) for t in texts[:count]]
    return [i for i in ids if len(i) <= 512]


def transformers_generate(target, prompts, batch: int, max_new: int) -> list[list[int]]:
    model, eos = target.model, target.eos_token_ids
    out = []
    for start in range(0, len(prompts), batch):
        rows = prompts[start: start + batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
        for row in gen[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            out.append(row[:cut])
    return out


def engine_generate(target, prompts, batch: int, max_new: int) -> list[list[int]]:
    out = [None] * len(prompts)
    for index, response, error in data.regenerate(target, prompts, max_new, batch_size=batch):
        out[index] = response
    return out


def main() -> None:
    count, batch, max_new, threads, rounds = (int(a) for a in (sys.argv[1:] + ["32", "16", "256", "2", "2"][
        len(sys.argv) - 1:])[:5])
    torch.set_num_threads(threads)
    target = load_target_cached("smollm2-135m")
    prompts = prompts_mix(target, count)
    print(f"{len(prompts)} prompts, batch {batch}, <= {max_new} new tokens, {threads} threads, float32")
    rates = {"transformers generate": [], "dflash engine": []}
    outputs = {}
    for r in range(rounds):
        order = list(rates) if r % 2 == 0 else list(reversed(rates))
        for name in order:
            fn = transformers_generate if name.startswith("transformers") else engine_generate
            start = time.perf_counter()
            responses = fn(target, prompts, batch, max_new)
            seconds = time.perf_counter() - start
            rates[name].append(sum(len(x) for x in responses) / seconds)
            outputs[name] = responses
            print(f"  {name:22s} {rates[name][-1]:7.1f} response tok/s ({seconds:.0f} s)", flush=True)
    same = sum(a == b for a, b in zip(*outputs.values()))
    best = {k: max(v) for k, v in rates.items()}
    print(f"best of {rounds}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in best.items())
          + f" -> {best['dflash engine'] / best['transformers generate']:.2f}x; identical responses {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
