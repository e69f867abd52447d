"""Does the trainer's surrogate tau predict what decoding sees? On the held-out split of a corpus, for each sequence:

- decode: the engine with whole blocks, greedy, float32 target, `MAX_NEW` new tokens after the corpus prompt;
- replay: the trainer's block forward with its anchors put exactly where decoding put its blocks (valid while the
  decoded tokens equal the corpus response, which the float32 target regenerated greedily). It must give the same
  accept lengths as decoding, block by block: any difference is a mismatch between training and inference;
- uniform: the trainer's surrogate with every position of the same first `MAX_NEW` response tokens as an anchor.

Usage: .venv/bin/python scripts/surrogate_vs_decode.py DRAFTER DATA [MAX_NEW] [EVAL_FRACTION] [LIMIT]
"""

import sys
from pathlib import Path

import numpy as np
import torch

from dflash import trainer
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods import registry
from dflash.methods.base import MethodOptions
from dflash.methods.dflash.objective import accept_lengths
from dflash.train_config import TrainConfig


def main() -> None:
    drafter, data = sys.argv[1:3]
    max_new = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    fraction = float(sys.argv[4]) if len(sys.argv) > 4 else 0.006
    limit = int(sys.argv[5]) if len(sys.argv) > 5 else None
    target = load_target_cached("smollm2-135m", "float32")
    recipe = registry.get("dflash").training
    model = recipe.load_model(Path(drafter), target)
    config = TrainConfig(method="dflash", anchors_per_seq=4096, eval_fraction=fraction)
    config = config.replace(recipe.shape_of(model))
    objective = recipe.objective(model, target, config)
    objective.model.eval()
    usable = [e for e in trainer.load_examples(data) if objective.usable(e)]
    _, heldout = trainer.split_heldout(usable, config.eval_fraction)
    heldout = heldout[:limit]
    proposer, _ = build_proposer("dflash", target, MethodOptions(drafter=drafter, block_size=16))
    decoder = SpeculativeDecoder(target, proposer, adaptive=False)

    decoded, replayed, uniform, same_tokens = [], [], [], 0
    for example in heldout:
        ids = example.input_ids.tolist()
        prompt, response = ids[:example.loss_start], ids[example.loss_start:]
        result = decoder.generate(prompt, GenerationConfig(max_new_tokens=max_new))
        lengths = result.stats.accept_lengths
        decoded += lengths
        n = len(result.tokens)
        if result.tokens != response[:n] or n < 17:
            continue  # the float32 target left the corpus response: no replay for this sequence
        same_tokens += 1
        sequence = objective.sequence(example.input_ids)
        starts = example.loss_start + np.concatenate([[0], np.cumsum(lengths[:-1])])
        full = [s for s, a in zip(starts, lengths) if s + 15 < example.loss_start + n]  # blocks not cut by MAX_NEW
        if not full:
            continue
        with torch.no_grad():
            got = objective.blocks_result(sequence, torch.as_tensor(full, dtype=torch.long), example.loss_start)
            replay = accept_lengths(got.correct).tolist()
            every = torch.arange(example.loss_start, min(example.loss_start + n, sequence.shape[0] - 1))
            uniform += accept_lengths(objective.blocks_result(sequence, every, example.loss_start).correct).tolist()
        mine = [a for s, a in zip(starts, lengths) if s + 15 < example.loss_start + n]
        replayed += [(a, b) for a, b in zip(mine, replay)]
    pairs = np.array(replayed)
    print(f"{len(heldout)} held-out sequences, {same_tokens} decoded exactly as the corpus")
    print(f"decode tau (all rounds): {np.mean(decoded):.3f} over {len(decoded)} rounds")
    print(f"replayed blocks: decode {pairs[:, 0].mean():.3f} / trainer {pairs[:, 1].mean():.3f}, "
          f"{int((pairs[:, 0] != pairs[:, 1]).sum())} of {len(pairs)} differ")
    print(f"uniform anchors over the same tokens: surrogate tau {np.mean(uniform):.3f} over {len(uniform)} blocks")


if __name__ == "__main__":
    main()
