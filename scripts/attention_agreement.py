"""How far apart two training attention kernels land on one step of the shipped drafter: what ATTENTION_AGREEMENT
(trainer.py) must allow between right kernels and must catch in a wrong one.

Usage: .venv/bin/python scripts/attention_agreement.py [sequences=2] [anchors=64]

One pass of the first corpus sequences through the shipped DFlash drafter and SmolLM2-135M on the CPU, in float32 and
under bfloat16 autocast, with three kernels: `blocks`; flex's path with a dense reference in place of FlexAttention's
kernel (which has no CPU backward pass; tests/test_training_attention.py); and a wrong kernel that ignores the block
mask. Prints the loss and the gradient norm of each.
"""

import sys
import time

import torch

sys.path.insert(0, "tests")

from dflash import trainer  # noqa: E402
from dflash.loading import load_target_cached  # noqa: E402
from dflash.methods.dflash import attention  # noqa: E402
from dflash.methods.dflash.drafter import DFlashDrafter  # noqa: E402
from dflash.methods.dflash.objective import DFlashObjective  # noqa: E402
from dflash.train_config import TrainConfig  # noqa: E402
from test_training_attention import reference_flex, unmasked_flex  # noqa: E402

DRAFTER = "src/dflash/drafters/smollm2-135m-dflash"


def main() -> int:
    sequences = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    anchors = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    target = load_target_cached("smollm2-135m")
    examples = trainer.load_examples("corpus/smollm2-135m")[:sequences]
    print(f"{'autocast':10} {'kernel':10} {'loss':>9} {'grad norm':>10} {'seconds':>8}")
    for dtype in (None, torch.bfloat16):
        for name, flex in (("blocks", None), ("flex-ref", reference_flex), ("unmasked", unmasked_flex)):
            drafter = DFlashDrafter.load(DRAFTER, dtype=torch.float32, device="cpu")
            objective = DFlashObjective(drafter, target, anchors_per_seq=anchors)
            objective.attention = "blocks" if flex is None else "flex"
            attention.compiled_flex = lambda flex=flex: flex
            config = TrainConfig(grad_accum=sequences, seqs_per_pass=sequences)
            run = trainer.Trainer(objective, config, "unused", examples, [], progress=False)
            run.autocast = lambda dtype=dtype: torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)
            started = time.perf_counter()
            totals = run.accumulate(list(range(sequences)), sequences)
            print(f"{str(dtype).removeprefix('torch.'):10} {name:10} {totals['loss'].item():9.5f} "
                  f"{trainer.gradient_norm(run.params):10.5f} {time.perf_counter() - started:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
