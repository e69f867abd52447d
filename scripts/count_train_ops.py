"""How many torch operations one DFlash training step dispatches, by part: on a GPU, its kernel launches.

Usage: .venv/bin/python scripts/count_train_ops.py [--sequences 8] [--anchors 512] [--cpu-chunks] [--json FILE]

On a GPU every operation is a kernel launch of ~5-10 microseconds of host time whatever its size, and the step of the
paper's recipe (8 sequences, 512 anchors, a 135M target) is small enough that launches and waits, not arithmetic,
set its pace (stage 15: 6.9 steps/s on an H200, where its arithmetic takes a few milliseconds). This counts them on
the CPU, with a random target shaped like SmolLM2-135M's layers and vocabulary (30 layers, 49,152 words; narrow, so
it runs in a minute) and a 2-layer drafter drafting over a 16K-word vocabulary, as the shipped one does. By default
the loss computes its logits in the chunks a GPU would (`chunk_rows_for`); --cpu-chunks keeps the CPU's.

A CPU cannot show the other cost, the waits (an operation whose size or value the host must read from the GPU, or a
blocking copy to it: each a full stop of the GPU's queue). tests/test_trainer.py::test_a_step_never_reads_the_device
checks that the drafter pass, the loss and the backward pass have none.
"""

import argparse
import collections
import json

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import dflash.methods.dflash.objective as objective_module
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.methods.dflash.objective import DFlashObjective
from dflash.testing import tiny_target
from dflash.trainer import Example

VOCAB = 49152


def labelled(function, label):
    def wrapper(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)
    return wrapper


def part_of(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("part:"):
            return parent.name[5:]
        parent = parent.cpu_parent
    return "other"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--cpu-chunks", action="store_true", help="the CPU's loss chunks (512 rows) instead of a GPU's")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    target = tiny_target("llama", vocab_size=VOCAB, num_layers=30, hidden_size=64)
    config = DFlashConfig.for_target(target.config, VOCAB, VOCAB - 1, num_layers=2, block_size=16, num_features=5)
    drafter = DFlashDrafter.untrained(config)
    drafter.draft_vocab = list(range(0, VOCAB, 3))
    objective = DFlashObjective(drafter, target, anchors_per_seq=args.anchors)
    if not args.cpu_chunks:  # a GPU's chunks for the loss (linear_cross_entropy looks the rule up by name)
        rule = objective_module.chunk_rows_for
        objective_module.chunk_rows_for = lambda device, vocab: rule(torch.device("cuda"), vocab)
    rng = np.random.default_rng(0)
    examples = [Example(str(i), torch.tensor(rng.integers(0, VOCAB - 2, size=int(n)), dtype=torch.int32), 100)
                for i, n in enumerate(rng.integers(600, 900, size=args.sequences))]

    objective.target_pass = labelled(objective.target_pass, "part:target")
    objective_module.block_loss = labelled(objective_module.block_loss, "part:loss")
    objective_module.build_block_batch = labelled(objective_module.build_block_batch, "part:blocks")
    drafter.forward = labelled(drafter.forward, "part:drafter")

    def step():
        results = objective.losses(examples, [np.random.default_rng(i) for i in range(len(examples))])
        with record_function("part:backward"):
            sum(loss for loss, _ in results).backward()

    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = collections.Counter(part_of(event) for event in prof.events() if event.name.startswith("aten::") and (
        event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")))  # top-level operations only
    print(f"{'part':10} {'ops':>6}   ({args.sequences} sequences, {args.anchors} anchors, "
          f"{'CPU' if args.cpu_chunks else 'GPU'} loss chunks)")
    for part in ("target", "blocks", "drafter", "loss", "backward", "other"):
        print(f"{part:10} {ops[part]:6d}")
    print(f"{'total':10} {sum(ops.values()):6d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sequences": args.sequences, "anchors": args.anchors, "cpu_chunks": args.cpu_chunks,
                       "ops": dict(ops)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
