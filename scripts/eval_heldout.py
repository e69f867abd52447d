"""Held-out surrogate tau of a drafter checkpoint on a training run's held-out split (the split `dflash train` makes
of DATA with its default --eval-fraction), e.g. to put a run's starting point on its learning curve.

Usage: .venv/bin/python scripts/eval_heldout.py dflash|eagle3 CHECKPOINT DATA [ANCHORS] [DTYPE] [EVAL_FRACTION]
(target: smollm2-135m in DTYPE, default bfloat16 under autocast as the shipped drafters trained; float32 runs
without autocast. EVAL_FRACTION is the run's --eval-fraction (default 0.02). A DFlash drafter with a draft
vocabulary is scored on it, as `dflash train` does. A DFlash drafter also gets eval_decode_tau: the tau of greedy
whole-block decoding over the first ANCHORS tokens of each held-out response.)
"""

import sys
from pathlib import Path

import numpy as np
import torch

from dflash import trainer
from dflash.loading import load_target_cached
from dflash.methods import registry
from dflash.train_config import TrainConfig


def main() -> None:
    method, checkpoint, data = sys.argv[1:4]
    anchors = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    dtype = sys.argv[5] if len(sys.argv) > 5 else "bfloat16"
    fraction = float(sys.argv[6]) if len(sys.argv) > 6 else TrainConfig.eval_fraction
    target = load_target_cached("smollm2-135m", dtype)
    recipe = registry.get(method).training
    model = recipe.load_model(Path(checkpoint), target)
    config = TrainConfig(method=method, anchors_per_seq=anchors, eval_fraction=fraction)
    config = config.replace(recipe.shape_of(model))
    objective = recipe.objective(model, target, config)
    usable = [e for e in trainer.load_examples(data) if objective.usable(e)]
    _, heldout = trainer.split_heldout(usable, config.eval_fraction)
    rngs = [np.random.default_rng([config.seed, trainer.EVAL_STREAM, i]) for i in range(len(heldout))]
    objective.model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        result = objective.evaluate(heldout, rngs)
    decode = f", eval_decode_tau {result['eval_decode_tau']:.3f}" if "eval_decode_tau" in result else ""
    print(f"{method} {checkpoint}: {len(heldout)} held-out sequences, eval_tau {result['eval_tau']:.3f}{decode}, "
          f"eval_loss {result['eval_loss']:.3f}")


if __name__ == "__main__":
    main()
