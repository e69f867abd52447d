"""Where a DFlash training step's time goes, with the loss over the whole vocabulary and over the draft vocabulary.

Usage: .venv/bin/python scripts/profile_train_step.py [DRAFTER] [CORPUS] [--sequences N] [--anchors A]
       [--threads T] [--json FILE]
(defaults: the shipped SmolLM2 drafter, corpus/smollm2-135m, 8 sequences, 128 anchors, torch's threads)

For each sequence it runs one training step's work (the target pass for features, the drafter pass over all blocks,
the loss with its LM head, the backward pass) twice, once per loss vocabulary, alternating which goes first, and
reports the seconds of each part summed over the sequences. The two losses' values differ (they are different
losses); the point is their cost.
"""

import argparse
import json
import time

import numpy as np
import torch

from dflash.loading import load_target_cached
from dflash.methods.dflash.drafter import DFlashDrafter
from dflash.methods.dflash.objective import DFlashObjective, block_loss, build_block_batch, sample_anchors
from dflash.trainer import load_examples

PARTS = ("target", "drafter", "loss", "backward")


def timed_step(objective: DFlashObjective, example, anchors_per_seq: int, vocabulary: str) -> dict[str, float]:
    objective.loss_vocab = vocabulary
    input_ids = objective.sequence(example.input_ids)
    anchors = sample_anchors(input_ids.shape[0], example.loss_start, anchors_per_seq, np.random.default_rng(0))
    target, drafter = objective.target, objective.model
    drafter.zero_grad(set_to_none=True)
    marks = [time.perf_counter()]
    features, _ = objective.target_pass(input_ids[None])
    marks.append(time.perf_counter())
    batch = build_block_batch(input_ids, anchors, objective.block_size, drafter.config.mask_token_id)
    with torch.no_grad():
        embeds = target.embed_tokens(batch.block_ids.reshape(1, -1))
    hidden = drafter(embeds, batch.positions.reshape(1, -1), features,
                     torch.arange(input_ids.shape[0])[None], mask=batch.layout)
    marks.append(time.perf_counter())
    result = block_loss(hidden.view(-1, objective.block_size, hidden.shape[-1]), batch.labels, target.lm_head,
                        objective.weights, vocab=objective.vocab_for(input_ids, example.loss_start))
    marks.append(time.perf_counter())
    result.loss.backward()
    marks.append(time.perf_counter())
    return {part: marks[i + 1] - marks[i] for i, part in enumerate(PARTS)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafter", nargs="?", default="src/dflash/drafters/smollm2-135m-dflash")
    p.add_argument("corpus", nargs="?", default="corpus/smollm2-135m")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--anchors", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target_cached("smollm2-135m")
    drafter = DFlashDrafter.load(args.drafter, dtype=torch.float32, device="cpu")
    if drafter.draft_vocab is None:
        raise SystemExit(f"{args.drafter} has no draft vocabulary to compare with")
    objective = DFlashObjective(drafter, target, args.anchors)
    examples = load_examples(args.corpus)[: args.sequences]
    totals = {v: dict.fromkeys(PARTS, 0.0) for v in ("full", "draft")}
    for i, example in enumerate(examples):
        for vocabulary in (("full", "draft") if i % 2 == 0 else ("draft", "full")):
            for part, seconds in timed_step(objective, example, args.anchors, vocabulary).items():
                totals[vocabulary][part] += seconds
    rows = len(drafter.draft_vocab)
    print(f"{len(examples)} sequences, {args.anchors} anchors, {torch.get_num_threads()} threads; draft vocabulary "
          f"{rows} of {drafter.config.vocab_size} rows (seconds, summed)")
    print(f"{'loss over':10}" + "".join(f"{part:>10}" for part in PARTS) + f"{'step':>10}")
    for vocabulary, parts in totals.items():
        print(f"{vocabulary:10}" + "".join(f"{parts[part]:10.2f}" for part in PARTS) + f"{sum(parts.values()):10.2f}")
    speedup = sum(totals["full"].values()) / sum(totals["draft"].values())
    print(f"step time, full / draft: {speedup:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sequences": len(examples), "anchors": args.anchors, "threads": torch.get_num_threads(),
                       "draft_rows": rows, "seconds": totals, "speedup": speedup}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
