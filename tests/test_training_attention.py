"""The drafter's training attention kernels (methods/dflash/attention.py): FlexAttention's block mask against the
dense definition, its values and gradients against `blocks`, and how `dflash train` picks a kernel."""

import shutil

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dflash import trainer
from dflash.cli import build_parser
from dflash.errors import UserError
from dflash.methods.dflash import attention, objective as objective_module
from dflash.methods.dflash.attention import TILE, BlockLayout, block_attention, block_sparse_attention, \
    flex_block_attention, flex_block_mask
from dflash.methods.dflash.objective import DFlashObjective, sample_anchors
from dflash.testing import tiny_target
from dflash.train_config import TrainConfig
from test_trainer import counting_records, eagle3_argv, tiny_drafter, train_args, write_shards


def random_layout(batch, nblocks, block_size, context, seed, capacity=0):
    """Sorted distinct anchors in [1, context) per row, as `sample_anchors` draws them."""
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.stack([torch.sort(torch.randperm(context - 1, generator=gen)[:nblocks] + 1).values
                           for _ in range(batch)])
    return BlockLayout(anchors, block_size, "flex", capacity)


def dense_truth(anchors, block_size, capacity):
    """[b, N, capacity + N]: query n (block n // B) sees context key j < its anchor and the keys of its own block."""
    per_query = anchors.repeat_interleave(block_size, dim=-1)
    n = per_query.shape[-1]
    keys = torch.arange(capacity + n)
    own_block = (keys - capacity).div(block_size, rounding_mode="floor")
    queries_block = torch.arange(n) // block_size
    context = keys[None, None] < per_query[..., None]
    own = own_block[None, None] == queries_block[None, :, None]
    return torch.where(keys < capacity, context, own)


def tiles(dense, queries, keys, reduce):
    """A [b, N, K] mask reduced over TILE x TILE tiles by `reduce` (any/all), padded rows and keys left out."""
    b = dense.shape[0]
    q_tiles, k_tiles = -(-queries // TILE), -(-keys // TILE)
    grid = torch.full((b, q_tiles * TILE, k_tiles * TILE), reduce is torch.all)
    grid[:, :queries, :keys] = dense
    return reduce(reduce(grid.view(b, q_tiles, TILE, k_tiles, TILE), dim=4), dim=2)


@pytest.mark.parametrize("nblocks,block_size,context,capacity", [
    (40, 16, 300, 0),  # 5 query tiles of 8 blocks each
    (37, 5, 200, 512),  # blocks across tile edges; a last partial tile; context padded past the real one
    (300, 16, 320, 0),  # blocks at nearly every position: many full context tiles
    (9, 16, 140, 256),
])
def test_block_mask_lists_exactly_the_tiles_to_compute(nblocks, block_size, context, capacity):
    """Partial or full: exactly the tiles holding a visible pair; full: exactly the context tiles all visible (the
    kernel skips mask_mod there); never both. Its mask_mod is the dense definition."""
    layout = random_layout(2, nblocks, block_size, context, seed=nblocks)
    capacity = attention.padded_capacity(BlockLayout(layout.anchors, block_size, capacity=capacity), context)
    queries = nblocks * block_size
    mask = flex_block_mask(layout.anchors, block_size, 2, queries, capacity)
    truth = dense_truth(layout.anchors, block_size, capacity)
    keys = capacity + queries
    partial, full = (torch.zeros(2, 1, -(-queries // TILE), -(-keys // TILE), dtype=torch.bool) for _ in range(2))
    for dense, counts, indices in ((partial, mask.kv_num_blocks, mask.kv_indices),
                                   (full, mask.full_kv_num_blocks, mask.full_kv_indices)):
        for b in range(2):
            for t in range(dense.shape[2]):
                dense[b, 0, t, indices[b, 0, t, : counts[b, 0, t]].long()] = True
    assert not (partial & full).any()
    assert torch.equal((partial | full)[:, 0], tiles(truth, queries, keys, torch.any))
    in_context = torch.arange(full.shape[-1]) * TILE < capacity
    assert torch.equal(full[:, 0], tiles(truth, queries, keys, torch.all) & in_context)
    assert full.any() or nblocks != 300  # the dense case has full tiles to skip mask_mod on
    assert torch.equal(create_mask(mask.mask_mod, 2, 1, queries, keys, device="cpu")[:, 0], truth)


def reference_flex(q, keys, values, block_mask, enable_gqa):
    """FlexAttention's definition, dense, with gradients on the CPU (the real kernel has no CPU backward pass)."""
    b, _, queries, _ = q.shape
    dense = create_mask(block_mask.mask_mod, b, 1, queries, keys.shape[2], device=q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=dense, enable_gqa=enable_gqa)


@pytest.mark.parametrize("kv_heads,block_size,capacity", [(4, 16, 0), (2, 5, 512), (1, 4, 0)])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: the reference
def test_flex_equals_blocks_in_values_and_gradients(kv_heads, block_size, capacity):
    """The padding of the context, the keys after it and GQA give `blocks`' outputs and every gradient; and
    FlexAttention's own (eager) forward agrees."""
    torch.manual_seed(kv_heads)
    heads, dim, context, nblocks = 4, 16, 150, 23
    layout = random_layout(2, nblocks, block_size, context, seed=block_size, capacity=capacity)
    n = nblocks * block_size
    tensors = [torch.randn(2, h, length, dim, dtype=torch.float64, requires_grad=True)
               for h, length in ((heads, n), (kv_heads, context), (kv_heads, context), (kv_heads, n), (kv_heads, n))]
    blocks = block_sparse_attention(*tensors, layout)
    flex = flex_block_attention(*tensors, layout, flex=reference_flex)
    torch.testing.assert_close(flex, blocks)
    grad = torch.randn_like(blocks)
    for ours, theirs in zip(torch.autograd.grad(flex, tensors, grad), torch.autograd.grad(blocks, tensors, grad)):
        torch.testing.assert_close(ours, theirs)
    with torch.no_grad():
        eager = flex_block_attention(*(t.float() for t in tensors), layout, flex=flex_attention)
    torch.testing.assert_close(eager, blocks.float(), atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="inductor needs a C++ compiler")
def test_compiled_flex_skips_only_what_no_query_sees():
    """The compiled kernel skips the tiles the block mask leaves out and skips mask_mod on full tiles: what the
    block mask says must then be right (the eager reference ignores it)."""
    torch.manual_seed(0)
    layout = random_layout(2, 60, 16, 400, seed=1)
    n = 60 * 16
    q, ctx_k, ctx_v, k, v = (torch.randn(2, h, length, 16) for h, length in ((4, n), (2, 400), (2, 400), (2, n), (2, n)))
    compiled = torch.compile(flex_attention, dynamic=False)
    out = flex_block_attention(q, ctx_k, ctx_v, k, v, layout, flex=compiled)
    torch.testing.assert_close(out, block_sparse_attention(q, ctx_k, ctx_v, k, v, layout), atol=2e-6, rtol=1e-5)


def test_a_pass_without_gradients_takes_blocks(monkeypatch):
    """Held-out evaluation and decoded anchors run without gradients: flex would compile a forward of its own."""
    monkeypatch.setattr(attention, "flex_block_attention", lambda *a: pytest.fail("flex ran without gradients"))
    layout = random_layout(1, 5, 4, 30, seed=0)
    tensors = [torch.randn(1, 2, length, 8) for length in (20, 30, 30, 20, 20)]
    with torch.no_grad():
        assert torch.equal(block_attention(*tensors, layout), block_sparse_attention(*tensors, layout))


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", logit_scale=4.0)


def test_flex_passes_pad_to_one_shape(target, monkeypatch):
    """flex compiles for one shape: its passes have anchors_per_seq blocks a sequence and the sequences per pass of
    the first; another count, or a pass without gradients, takes blocks."""
    objective = DFlashObjective(tiny_drafter(target), target, anchors_per_seq=16)
    assert objective.pass_kernel(3, 10) == ("blocks", 10)  # blocks set
    objective.attention = "flex"
    assert objective.pass_kernel(3, 10) == ("flex", 16)
    assert objective.pass_kernel(3, 16) == ("flex", 16)
    assert objective.pass_kernel(2, 10) == ("blocks", 10)
    with torch.no_grad():
        assert objective.pass_kernel(3, 10) == ("blocks", 10)


def test_compiled_passes_pad_to_one_shape_and_auto_times_it_on_a_gpu(target, monkeypatch):
    """compiled, like flex, compiles for one shape of the blocks; auto times it where torch.compile has a GPU code
    generator (CUDA with triton) and never on a CPU."""
    objective = DFlashObjective(tiny_drafter(target), target, anchors_per_seq=16, attention="compiled")
    assert objective.pass_kernel(3, 10) == ("compiled", 16)
    assert objective.pass_kernel(2, 10) == ("blocks", 10)
    with torch.no_grad():
        assert objective.pass_kernel(3, 10) == ("blocks", 10)
    auto = DFlashObjective(tiny_drafter(target), target, anchors_per_seq=16, attention="auto")
    assert auto.attention_choices() == ["blocks"]
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(attention.shutil, "which", lambda name: None)  # a CPU without a C++ compiler
    with pytest.raises(UserError, match="--attention compiled: torch.compile needs a C\\+\\+ compiler"):
        DFlashObjective(tiny_drafter(target), target, anchors_per_seq=16, attention="compiled")
    monkeypatch.undo()
    monkeypatch.setattr(objective_module, "flex_unavailable", lambda device: "")
    monkeypatch.setattr(objective_module, "compiled_unavailable", lambda device: "")
    assert auto.attention_choices() == ["blocks", "flex", "compiled"]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_compiled_layers_train_as_blocks_does(device):
    """A pass with the drafter's layers compiled (inductor: C++ on a CPU, triton on a GPU) gives the loss and every
    gradient of the eager layers, on two sequences of different lengths; a second pass with another context length
    reuses the compile (the length is dynamic) and agrees too."""
    import torch._dynamo.utils

    target = tiny_target("llama", logit_scale=4.0)
    target.model.to(device)

    def pass_of(attention, lengths, seed):
        torch.manual_seed(0)
        drafter = tiny_drafter(target, num_layers=2, block_size=4, seed=1).to(device)
        objective = DFlashObjective(drafter, target, anchors_per_seq=6, attention=attention)
        records = counting_records(2, seed=seed)
        sequences = [torch.tensor(r["input_ids"][:n]) for r, n in zip(records, lengths)]
        anchors = [sample_anchors(len(seq), 8, 6, np.random.default_rng(i)) for i, seq in enumerate(sequences)]
        results = objective.blocks_results(sequences, anchors, [8, 8])
        loss = sum(result.loss for result in results)
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in drafter.named_parameters()}

    for lengths, seed in (((30, 22), 1), ((40, 35), 2)):
        eager_loss, eager_grads = pass_of("blocks", lengths, seed)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled_loss, compiled_grads = pass_of("compiled", lengths, seed)
        assert seed > 1 or torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # it did compile
        torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=1e-5)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if seed == 1:
            compiled_graphs = graphs
    assert graphs == compiled_graphs  # the second length compiled nothing new


def test_flex_on_a_cpu_and_unknown_kernels_are_user_errors(target, tmp_path):
    with pytest.raises(UserError, match="--attention flex: FlexAttention trains on CUDA only"):
        DFlashObjective(tiny_drafter(target), target, anchors_per_seq=16, attention="flex")
    with pytest.raises(UserError, match="attention must be auto, blocks, flex"):
        TrainConfig(attention="dense").validate()
    data = write_shards(tmp_path / "data", counting_records(6))
    with pytest.raises(UserError, match="--attention flex: FlexAttention trains on CUDA only"):
        trainer.run(train_args(data, tmp_path / "out", "--attention", "flex"))
    with pytest.raises(UserError, match="applies to --method dflash only"):
        trainer.run(build_parser().parse_args(eagle3_argv(data, tmp_path / "eagle", "--attention", "blocks")))
    auto = DFlashObjective(tiny_drafter(target), target, anchors_per_seq=16, attention="auto")
    assert auto.attention_choices() == ["blocks"] and auto.attention == "blocks"


def new_trainer(target, examples, attention_setting="auto"):
    drafter = tiny_drafter(target, num_layers=1, block_size=4, seed=2)
    objective = DFlashObjective(drafter, target, anchors_per_seq=16, attention=attention_setting)
    config = TrainConfig(grad_accum=4, seqs_per_pass=4, lr=1e-2)
    return trainer.Trainer(objective, config, "unused", examples, [], progress=False)


def unmasked_flex(q, keys, values, block_mask, enable_gqa):
    """A wrong kernel: one that ignores the block mask (every block sees every key)."""
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=enable_gqa)


@pytest.mark.parametrize("flex", ["works", "fails", "wrong"])
def test_the_first_step_times_the_kernels(target, monkeypatch, capsys, flex):
    """auto on a GPU: the first step times blocks and flex on gradients it throws away (the step computes what it
    would have), and keeps the faster. A kernel that fails there (here the eager one: no CPU backward pass), or
    whose loss or gradient norm is not blocks' (here one that ignores the mask: on this tiny drafter its gradient
    norm is 0.28 against 0.77), is left out, and the run goes on."""
    examples = [trainer.example_of(r) for r in counting_records(8, seed=3)]
    plain = new_trainer(target, examples, "blocks")
    monkeypatch.setattr(objective_module, "flex_unavailable", lambda device: "")  # as on a GPU
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return reference_flex(*args, **kwargs)

    kernel = {"works": counted, "fails": flex_attention, "wrong": unmasked_flex}[flex]
    monkeypatch.setattr(attention, "compiled_flex", lambda: kernel)
    timed = new_trainer(target, examples)
    assert timed.objective.attention_choices() == ["blocks", "flex"]
    indices = [5, 1, 6, 2]
    for step in range(3):
        measured, expected = timed.train_step(indices), plain.train_step(indices)
        if step == 0:
            said = capsys.readouterr().err
            assert "[dflash] training attention: " in said
            assert ("flex failed here, left out: NotImplementedError" in said) == (flex == "fails")
            assert ("flex disagrees with blocks, left out" in said) == (flex == "wrong")
            chosen = timed.objective.attention
            assert chosen == "blocks" or flex == "works"
            timed.objective.attention = "flex" if flex == "works" else "blocks"  # the steps after: each kernel's
        torch.testing.assert_close(measured["grad_norm"], expected["grad_norm"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(measured["loss"], expected["loss"], atol=1e-6, rtol=1e-5)
    # the timing's two runs, the first step where flex won, then two steps (a layer each)
    assert len(calls) == (2 + (chosen == "flex") + 2 if flex == "works" else 0)


def test_blocks_under_bfloat16_autocast_match_the_definition():
    """Under autocast the softmax runs on the bfloat16 scores (summing in float32), not on a float32 copy: the
    output and gradients stay within bfloat16's rounding of the float64 definition."""
    torch.manual_seed(3)
    layout = random_layout(2, 12, 4, 40, seed=3)
    shapes = ((4, 48), (2, 40), (2, 40), (2, 48), (2, 48))
    exact = [torch.randn(2, h, length, 16, dtype=torch.float64, requires_grad=True) for h, length in shapes]
    rounded = [t.detach().float().requires_grad_() for t in exact]
    reference = block_sparse_attention(*exact, layout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block_sparse_attention(*(t @ torch.eye(16) for t in rounded), layout)  # bfloat16 products, as in a layer
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference, atol=3e-2, rtol=3e-2)
    grad = torch.randn_like(reference)
    ours = torch.autograd.grad(out, rounded, grad.to(out.dtype))
    theirs = torch.autograd.grad(reference, exact, grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, atol=6e-2, rtol=5e-2)


class ScorePasses(TorchDispatchMode):
    """Counts the tensors at least `size` elements big that operations read or write (an `out=` tensor once)."""

    FREE = {"view", "_unsafe_view", "as_strided", "slice", "select", "transpose", "t", "expand", "detach", "alias",
            "empty", "empty_strided", "empty_like", "new_empty"}

    def __init__(self, size: int):
        super().__init__()
        self.size, self.passes = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {key: value for key, value in (kwargs or {}).items() if key != "out"}
        tensors = [t for t in tree_flatten((args, given, out))[0] if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        big = sum(t.numel() >= self.size for t in tensors)
        if big and name not in self.FREE:
            self.passes.append((name, big))
        return out


def test_blocks_passes_over_the_scores_13_times_forward_and_backward():
    """On a GPU the [b, H, N, S + B] scores are the step's largest tensors and each pass over them is memory
    traffic: `blocks` writes them once (no concatenation), masks them in place, and its backward pass neither
    stitches slices back together nor masks the gradient (hidden scores have probability 0, so the softmax's
    backward gives them 0). torch's operations took 23 passes; a regression shows here. Counted on the meta
    device, which moves no data."""
    b, heads, kv_heads, nblocks, size, context, dim = 2, 4, 2, 8, 4, 40, 8
    tensors = [torch.randn(b, h, length, dim, device="meta", requires_grad=True)
               for h, length in ((heads, nblocks * size), (kv_heads, context), (kv_heads, context),
                                 (kv_heads, nblocks * size), (kv_heads, nblocks * size))]
    layout = BlockLayout(torch.arange(nblocks, device="meta") * 4 + 2, size)
    with ScorePasses(b * heads * nblocks * size * context) as counted:
        out = block_sparse_attention(*tensors, layout)
        torch.autograd.grad(out, tensors, torch.empty_like(out))
    names = [name for name, _ in counted.passes]
    assert sum(big for _, big in counted.passes) <= 13, counted.passes
    assert "cat" not in names and "slice_backward" not in names and names.count("masked_fill_") == 1


def test_the_block_mask_is_built_without_reading_the_device():
    """Built on the anchors' device by tensor operations alone: on a GPU nothing waits for it. The meta device has
    no values, so any read (a size that depends on values, .item(), a boolean index) would fail here."""
    anchors = torch.empty(8, 512, dtype=torch.long, device="meta")
    mask = flex_block_mask(anchors, 16, 8, 512 * 16, 3072)
    assert mask.kv_num_blocks.device.type == "meta" and mask.kv_indices.shape == (8, 1, 64, 88)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: FlexAttention's backward pass runs there only")
def test_compiled_flex_on_cuda_equals_blocks_in_values_and_gradients():
    """The real kernel, compiled, forward and backward, against `blocks` (float32, so that only the order of the
    sums differs), at the lease's tile layout: 16-token blocks, GQA, a context padded past the real one."""
    torch.manual_seed(0)
    layout = random_layout(2, 64, 16, 700, seed=5, capacity=1024)
    layout.anchors = layout.anchors.cuda()
    n = 64 * 16
    tensors = [torch.randn(2, h, length, 64, device="cuda", requires_grad=True)
               for h, length in ((9, n), (3, 700), (3, 700), (3, n), (3, n))]
    flex = flex_block_attention(*tensors, layout)
    blocks = block_sparse_attention(*tensors, layout)
    torch.testing.assert_close(flex, blocks, atol=1e-4, rtol=1e-3)  # a wrong tile is off by O(1)
    grad = torch.randn_like(blocks)
    for ours, theirs in zip(torch.autograd.grad(flex, tensors, grad), torch.autograd.grad(blocks, tensors, grad)):
        torch.testing.assert_close(ours, theirs, atol=5e-4, rtol=5e-3)


def test_a_pass_builds_its_block_mask_once(target, monkeypatch):
    """Every layer of a pass attends under the same layout: the block mask is built for the first and reused."""
    built = []
    real = attention.flex_block_mask
    monkeypatch.setattr(attention, "flex_block_mask", lambda *args: built.append(1) or real(*args))
    monkeypatch.setattr(attention, "compiled_flex", lambda: reference_flex)
    objective = DFlashObjective(tiny_drafter(target, num_layers=2), target, anchors_per_seq=16)
    objective.attention = "flex"
    examples = [trainer.example_of(r) for r in counting_records(2, seed=4)]
    losses = objective.losses(examples, [np.random.default_rng(i) for i in range(2)])
    assert len(built) == 1 and all(torch.isfinite(loss) for loss, _ in losses)
