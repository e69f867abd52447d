"""The bytes one DFlash training step's operations read and write, at the paper's recipe's shapes on SmolLM2-135M.

Usage: .venv/bin/python scripts/step_traffic.py [--sequences 8] [--anchors 512] [--dtype bfloat16] [--top 25]
                                                [--loss ce|kl] [--json FILE]

On a GPU the drafter's step is bound by memory traffic, not arithmetic: stage 16's H100 profile (124 ms of device time
a step) was mostly elementwise kernels, copies and the attention's [heads, blocks x 16, context] scores, whose
products take a few ms. A CPU cannot time that, but it can count it: the drafter pass, the loss and the backward
pass run here on the meta device (shapes, no values, no memory), every operation is logged with the bytes of its
tensors, and the total is the traffic a GPU step moves at the least. The target's pass is not in it (a bfloat16
forward of SmolLM2 over the step's sequences, ~1 GB of weights and activations; with `--loss kl` also its LM head at
every position, whose logits the loss reads as the teacher's).

`--dtype bfloat16` stands in for autocast (the meta device has none): the drafter's weights and the target's
features are bfloat16, while the operations that widen to float32 (norms, RoPE, softmax statistics) do so as they
would. It also counts the products with an operand whose rows are not a multiple of 16 bytes long, which cuBLAS
runs on older, slower kernels (stage 16's profile: cutlass_75 kernels on an H100). Views cost nothing, an `out=` tensor is written and not read; an index, gather or index_put counts the rows it moves, not the tensor it reads from.
"""

import argparse
import collections
import json
import types

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dflash.methods.dflash.objective as objective_module
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter, default_target_layer_ids
from dflash.methods.dflash.objective import DFlashObjective, sample_anchors

VOCAB, WIDTH, FEATURES = 49152, 576, 5
FREE = {"view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze",
        "permute", "detach", "alias", "split", "split_with_sizes", "unbind", "_reshape_alias", "empty",
        "empty_strided", "lift_fresh", "new_empty", "new_empty_strided", "empty_like"}
SPARSE = {"index", "gather", "index_select", "embedding"}  # read and write the rows they pick
CREATE = {"new_full", "new_zeros", "new_ones", "full_like", "zeros_like", "ones_like"}  # read only a shape
SCATTER = {"index_put_", "index_put", "scatter_", "scatter_add_", "index_add_"}  # write the values they are given


PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "matmul"}
ALIGNMENT = 16  # bytes: a tensor-core kernel's operand rows start on 16-byte boundaries


def aligned(t: torch.Tensor) -> bool:
    """Whether every stride but the unit one (a matrix's row length, or a batch's) is a multiple of 16 bytes."""
    return t.dim() < 2 or all(stride * t.element_size() % ALIGNMENT == 0 for stride in t.stride() if stride != 1)


def size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TrafficLog(TorchDispatchMode):
    """Every operation's name and the bytes it moves, in the order run."""

    def __init__(self):
        super().__init__()
        self.rows, self.phase = [], "forward"
        self.misaligned = collections.Counter()  # products with an operand misaligned for tensor cores, by shape

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in FREE:
            return out
        given = {key: value for key, value in (kwargs or {}).items() if key != "out"}  # `out` is written, not read
        inputs = [t for t in tree_flatten((args, given))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in CREATE:
            moved = sum(map(size, outputs))
        elif name in SPARSE:
            moved = 2 * sum(map(size, outputs)) + sum(map(size, inputs[1:]))
        elif name in SCATTER:
            moved = 2 * sum(map(size, inputs[1:]))
        else:
            moved = sum(map(size, inputs)) + sum(map(size, outputs))
        self.rows.append((self.phase, name, moved, [tuple(t.shape) for t in inputs[:2]]))
        if name in PRODUCTS and any(not aligned(t) for t in inputs + outputs):
            self.misaligned[(self.phase, name, str([tuple(t.shape) for t in inputs[:2]]))] += 1
        return out


def recipe_step(sequences: int, anchors: int, dtype: torch.dtype, seed: int = 0, distill: bool = False) -> TrafficLog:
    """The drafter pass, loss and backward of one step of `sequences` corpus-like sequences (650-850 tokens, the
    response from 100 on), SmolLM2-135M's shapes, a 2-layer drafter over a 16K-word draft vocabulary, the loss in a
    GPU's chunks (`distill`: against the target's logits, --loss kl)."""
    config = DFlashConfig(hidden_size=WIDTH, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, num_hidden_layers=2, vocab_size=VOCAB, block_size=16,
                          num_target_layers=30, target_layer_ids=default_target_layer_ids(30, FEATURES),
                          mask_token_id=VOCAB - 1)
    drafter = DFlashDrafter.untrained(config).to("meta").to(dtype)
    drafter.draft_vocab = list(range(0, VOCAB, 3))
    target = types.SimpleNamespace(
        device=torch.device("meta"), max_context=4096,
        lm_head=torch.nn.Linear(WIDTH, VOCAB, bias=False, device="meta", dtype=dtype),
        embed_tokens=torch.nn.Embedding(VOCAB, WIDTH, device="meta", dtype=dtype))
    rule = objective_module.chunk_rows_for
    objective_module.chunk_rows_for = lambda device, vocab: rule(torch.device("cuda"), vocab)
    objective = DFlashObjective(drafter, target, anchors_per_seq=anchors, distill=distill)
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(650, 850, size=sequences)]
    ids = [torch.tensor(rng.integers(0, VOCAB - 2, size=n)) for n in lengths]
    anchor_sets = [sample_anchors(n, 100, anchors, np.random.default_rng(i)) for i, n in enumerate(lengths)]
    length = objective.padded(ids).shape[1]  # as a training pass pads its sequences
    features = torch.empty(sequences, length, FEATURES * WIDTH, device="meta", dtype=dtype)
    logits = torch.empty(sequences, length, VOCAB, device="meta", dtype=dtype) if distill else None
    log = TrafficLog()
    try:
        with log:
            results = objective.blocks_results(ids, anchor_sets, [100] * sequences, context=(features, logits))
            loss = sum(result.loss for result in results)
            log.phase = "backward"
            loss.backward()
    finally:
        objective_module.chunk_rows_for = rule
    return log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--loss", default="ce", choices=["ce", "kl"], help="kl: self-distillation (--loss kl)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    log = recipe_step(args.sequences, args.anchors, getattr(torch, args.dtype), distill=args.loss == "kl")
    by_op = collections.defaultdict(lambda: [0, 0])
    for phase, name, moved, _ in log.rows:
        by_op[(phase, name)][0] += 1
        by_op[(phase, name)][1] += moved
    total = sum(moved for *_, moved, _ in log.rows)
    print(f"{args.sequences} sequences x {args.anchors} anchors, {args.dtype}, loss {args.loss}: "
          f"{len(log.rows)} operations, {total / 1e9:.1f} GB")
    for phase in ("forward", "backward"):
        count = sum(1 for row in log.rows if row[0] == phase)
        moved = sum(row[2] for row in log.rows if row[0] == phase)
        print(f"  {phase:9s} {count:5d} operations {moved / 1e9:7.1f} GB")
    misaligned = sum(log.misaligned.values())
    print(f"  products with an operand misaligned for tensor cores (rows not a multiple of {ALIGNMENT} bytes): "
          f"{misaligned}")
    for (phase, name, shapes), calls in log.misaligned.most_common(4):
        print(f"    {phase} {name} {shapes} x{calls}")
    print(f"{'pass':9s} {'operation':28s} {'calls':>5s} {'GB':>7s}")
    for (phase, name), (calls, moved) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{phase:9s} {name:28s} {calls:5d} {moved / 1e9:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sequences": args.sequences, "anchors": args.anchors, "dtype": args.dtype, "loss": args.loss,
                       "operations": len(log.rows), "bytes": total, "misaligned_products": misaligned,
                       "by_op": [{"pass": ph, "op": nm, "calls": c, "bytes": b}
                                 for (ph, nm), (c, b) in sorted(by_op.items(), key=lambda kv: -kv[1][1])]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
