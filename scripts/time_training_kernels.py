"""CPU timings of the training step's parts at SmolLM2-135M's widths: the `blocks` attention, the drafter's layers
eager and compiled (the `compiled` kernel), and the loss.

Usage: .venv/bin/python scripts/time_training_kernels.py attention|layers|loss [--anchors 128] [--threads 2]
       [--repeats 5]

`attention` and `loss` (linear_cross_entropy, 2048 rows x 16K words; and one chunk's terms, eager against compiled,
where the package has them) run on any version of the package, so two
versions compare side by side: `PYTHONPATH=<a worktree of the old commit>/src .venv/bin/python
scripts/time_training_kernels.py attention`, alternating with this tree's run. `layers` times both layers'
forward and backward at the context's 800 positions, eager against compiled, interleaved, after the compile. Each
prints the median of the repeats in ms, float32.
"""

import argparse
import statistics
import time

import torch

WIDTH, HEADS, KV_HEADS, HEAD_DIM, CONTEXT, BLOCK = 576, 9, 3, 64, 800, 16


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def attention_case(anchors: int):
    from dflash.methods.dflash.attention import BlockLayout, block_sparse_attention

    gen = torch.Generator().manual_seed(0)
    layout = BlockLayout(torch.sort(torch.randint(100, CONTEXT, (1, anchors), generator=gen)).values, BLOCK)
    n = anchors * BLOCK
    tensors = [torch.randn(1, h, length, HEAD_DIM, generator=gen, requires_grad=True)
               for h, length in ((HEADS, n), (KV_HEADS, CONTEXT), (KV_HEADS, CONTEXT), (KV_HEADS, n), (KV_HEADS, n))]
    grad = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen)
    return {"blocks": lambda: torch.autograd.grad(block_sparse_attention(*tensors, layout), tensors, grad)}


def layers_case(anchors: int):
    from dflash.methods.dflash.attention import BlockLayout
    from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter

    config = DFlashConfig(hidden_size=WIDTH, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=1000, num_target_layers=30,
                          target_layer_ids=[1, 7, 13, 19, 25], mask_token_id=999, block_size=BLOCK)
    drafter = DFlashDrafter.untrained(config)
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, anchors * BLOCK, WIDTH, generator=gen)
    positions = torch.arange(anchors * BLOCK)[None] + 1
    features = torch.randn(1, CONTEXT, 5 * WIDTH, generator=gen)
    anchor_ids = torch.sort(torch.randint(100, CONTEXT, (1, anchors), generator=gen)).values

    def step(kernel):
        drafter.zero_grad(set_to_none=True)
        out = drafter(embeds, positions, features, torch.arange(CONTEXT)[None],
                      mask=BlockLayout(anchor_ids, BLOCK, kernel))
        out.square().mean().backward()

    compile_seconds = seconds(lambda: step("compiled"))
    print(f"compiled: first run (the compile) {compile_seconds:.1f} s")
    return {"eager": lambda: step("blocks"), "compiled": lambda: step("compiled")}


def loss_case(_anchors: int):
    from dflash.methods.dflash.objective import linear_cross_entropy

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 2048, 16384
    hidden = torch.randn(rows, WIDTH, generator=gen, requires_grad=True)
    head = torch.randn(vocab, WIDTH, generator=gen) * 0.05
    labels, weights = torch.randint(0, vocab, (rows,), generator=gen), torch.rand(rows, generator=gen)

    def run():
        hidden.grad = None
        linear_cross_entropy(hidden, head, labels, weights)[0].backward()

    runs = {"linear_cross_entropy": run}
    try:  # a chunk's terms, eager and compiled (this tree's kernels; an older tree has neither)
        from dflash.methods.dflash.objective import compiled_terms, hard_label_terms
    except ImportError:
        return runs
    logits = hidden.detach() @ head.t()
    args = (labels, weights, weights.sum(), torch.float32, True)
    print(f"compiled terms: first run (the compile) {seconds(lambda: compiled_terms()(logits, *args)):.1f} s")
    runs["terms eager"] = lambda: hard_label_terms(logits, *args)
    runs["terms compiled"] = lambda: compiled_terms()(logits, *args)
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["attention", "layers", "loss"])
    p.add_argument("--anchors", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runs = {"attention": attention_case, "layers": layers_case, "loss": loss_case}[args.part](args.anchors)
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            times[name].append(seconds(run))
    print(f"{args.part}, {args.anchors} anchors, {args.threads} threads, float32: " + ", ".join(
        f"{name} {statistics.median(t) * 1000:.0f} ms" for name, t in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
