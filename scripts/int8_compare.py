"""An int8 target (`--dtype int8`) against the bfloat16 one it rounds, in one process: speed, generation by
generation interleaved, and how far the int8 model's text moves from the bfloat16 model's.

Usage: .venv/bin/python scripts/int8_compare.py [DATASETS] [LIMIT] [METHODS] [MAX_NEW] [--json FILE]
(defaults: gsm8k,mt_bench,humaneval, 6 prompts each, ar,dflash+ngram, 128 new tokens; SmolLM2-135M-Instruct,
greedy, the shipped drafters; threads: torch's)

Per prompt and method, each precision generates once, alternating which goes first; the figures are the medians
over prompts of the per-prompt time ratios (int8 / bfloat16), so the shared machine's drift cancels. Quality, on
each prompt's bfloat16 greedy answer (teacher-forced, both models reading the same tokens): how often the int8
model's next-token argmax is the bfloat16 model's, and the mean KL divergence of its distribution from theirs; the
float32 model against the bfloat16 one the same way, for scale (bfloat16 itself moves text away from float32).
Also: how many int8 (and float32) greedy answers equal the bfloat16 ones, and where int8's others first differ.
"""

import argparse
import json
import statistics
import sys
import time

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached


def generate(target, proposer, ids, max_new):
    decoder = SpeculativeDecoder(target, proposer)
    start = time.perf_counter()
    result = decoder.generate(ids, GenerationConfig(max_new_tokens=max_new, ignore_eos=False))
    seconds = time.perf_counter() - start
    rounds = result.stats.accept_lengths
    return result.tokens, seconds, (sum(rounds) / len(rounds) if rounds else None)


@torch.inference_mode()
def teacher_forced(target, ids: list[int], answer: list[int]) -> torch.Tensor:
    """log-probabilities [len(answer), vocab] of each answer token's position, reading prompt + answer"""
    out = target.forward(torch.tensor([ids + answer]), target.new_cache(capacity=len(ids) + len(answer) + 8))
    return torch.log_softmax(out.logits[0, len(ids) - 1: len(ids) + len(answer) - 1].float(), dim=-1)


def agreement(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(fraction of positions with the same argmax, mean KL(reference || other))"""
    same = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    kl = (reference.exp() * (reference - other)).sum(-1).mean().item()
    return same, kl


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("datasets", nargs="?", default="gsm8k,mt_bench,humaneval")
    p.add_argument("limit", nargs="?", type=int, default=6)
    p.add_argument("methods", nargs="?", default="ar,dflash+ngram")
    p.add_argument("max_new", nargs="?", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    targets = {name: load_target_cached("smollm2-135m", name) for name in ("bfloat16", "int8", "float32")}
    methods = args.methods.split(",")
    proposers = {(m, name): build_proposer(m, targets[name])[0] if m != "ar" else None
                 for m in methods for name in ("bfloat16", "int8")}
    rows = []
    for dataset in args.datasets.split(","):
        path, template = resolve_dataset(dataset)
        for k, prompt in enumerate(read_prompts(path, template, args.limit)):
            ids = targets["bfloat16"].encode_prompt(prompt.turns[0])  # as the bench sends a first turn
            row = {"dataset": dataset, "id": prompt.id}
            for m in methods:
                order = ("bfloat16", "int8") if k % 2 == 0 else ("int8", "bfloat16")
                for name in order:
                    tokens, seconds, tau = generate(targets[name], proposers[(m, name)], ids, args.max_new)
                    row[f"{m}:{name}"] = {"tokens": tokens, "s": seconds, "tau": tau}
            reference = row[f"{methods[0]}:bfloat16"]["tokens"]
            int8_tokens = row[f"{methods[0]}:int8"]["tokens"]
            row["same_text"] = int8_tokens == reference
            row["same_text_f32"] = generate(targets["float32"], None, ids, args.max_new)[0] == reference
            row["first_difference"] = next((i for i, (a, b) in enumerate(zip(reference, int8_tokens)) if a != b),
                                           None if len(reference) == len(int8_tokens) else min(len(reference),
                                                                                               len(int8_tokens)))
            logp = {name: teacher_forced(t, ids, reference) for name, t in targets.items()}
            row["int8_vs_bf16"] = agreement(logp["bfloat16"], logp["int8"])
            row["f32_vs_bf16"] = agreement(logp["bfloat16"], logp["float32"])
            rows.append(row)
            print(f"{dataset} {prompt.id}: " + "  ".join(
                f"{m} {row[f'{m}:int8']['s'] / row[f'{m}:bfloat16']['s']:.2f}x" for m in methods)
                + f"  same text int8 {row['same_text']} f32 {row['same_text_f32']}"
                f"  argmax agreement int8 {row['int8_vs_bf16'][0]:.3f}"
                f" f32 {row['f32_vs_bf16'][0]:.3f}", flush=True)
    print()
    for dataset in args.datasets.split(",") + ["all"]:
        chosen = [r for r in rows if dataset in ("all", r["dataset"])]
        parts = []
        for m in methods:
            ratio = statistics.median(r[f"{m}:int8"]["s"] / r[f"{m}:bfloat16"]["s"] for r in chosen)
            tokps = {name: sum(len(r[f"{m}:{name}"]["tokens"]) for r in chosen)
                     / sum(r[f"{m}:{name}"]["s"] for r in chosen) for name in ("bfloat16", "int8")}
            taus = [r[f"{m}:{name}"]["tau"] for r in chosen for name in ("bfloat16", "int8")]
            tau = "" if None in taus else " tau bf16 {:.2f} int8 {:.2f}".format(
                *(statistics.mean(r[f"{m}:{name}"]["tau"] for r in chosen) for name in ("bfloat16", "int8")))
            parts.append(f"{m}: time int8/bf16 {ratio:.3f} (median), {tokps['bfloat16']:.1f} -> "
                         f"{tokps['int8']:.1f} tok/s{tau}")
        same = sum(r["same_text"] for r in chosen)
        same_f32 = sum(r["same_text_f32"] for r in chosen)
        agree = {key: statistics.mean(r[key][0] for r in chosen) for key in ("int8_vs_bf16", "f32_vs_bf16")}
        kl = {key: statistics.mean(r[key][1] for r in chosen) for key in ("int8_vs_bf16", "f32_vs_bf16")}
        print(f"{dataset} ({len(chosen)}): " + "; ".join(parts)
              + f"; greedy text as bf16's: int8 {same}/{len(chosen)}, f32 {same_f32}/{len(chosen)}; "
              f"argmax agreement with bf16: int8 {agree['int8_vs_bf16']:.4f} (KL {kl['int8_vs_bf16']:.5f}), "
              f"f32 {agree['f32_vs_bf16']:.4f} (KL {kl['f32_vs_bf16']:.5f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
