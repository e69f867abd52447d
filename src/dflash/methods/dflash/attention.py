"""The drafter's training attention: every block of a sequence over one context, in one pass (DFLASH_SPEC.md section 4).

Block i, anchored at position a_i, sees the context positions before a_i and its own block (bidirectionally), never
another block. Two kernels compute it, with the same result:
- `blocks` (any device): scores against the context and against the block's own keys, one softmax over both, in
  torch operations. It materialises the [heads, N, S] scores. On a GPU they are read and written several times a
  layer, forward and backward: 8 sequences x 8,192 block tokens x ~750 context positions is ~0.9 GB in bfloat16 each
  time, likely most of a step's memory traffic.
- `flex` (CUDA): PyTorch's FlexAttention, compiled, over a block mask built here from the anchors. Tiles of keys
  that a tile of queries cannot see are skipped, and no score leaves the kernel. FlexAttention has no CPU backward
  pass. The context is padded to a fixed capacity, so one compile serves every step.
- `compiled` (CUDA by default; any device when asked for): `blocks`, with the drafter's layers around it compiled by
  torch.compile, so that their norms, RoPE, SwiGLU and autocast's casts run as a few fused kernels instead of ~60
  operations a layer each way, each a pass over a [sequences, 8,192, ...] tensor on a GPU. The attention itself
  stays the autograd function below (the compiler never traces it). The context's length is marked dynamic, so
  one compile serves every step.
`dflash train` picks the kernel by timing its first step on a GPU (trainer `timed_attention`).
"""

from __future__ import annotations

import importlib
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KERNELS = ("blocks", "flex", "compiled")
TILE = 128  # FlexAttention's tile: queries and keys in blocks of 128


@dataclass
class BlockLayout:
    """The training layout of a drafter call: the query tokens are len(anchors) blocks of block_size tokens, block i
    anchored at position anchors[i], and the context holds positions 0..S-1. Block i sees context positions
    < anchors[i] and its own block bidirectionally, never another block. Passed instead of a dense mask so attention
    never materialises the [N, S + N] mask, of which all but N * (S + B) entries are False.
    anchors [b, nblocks] gives each row of a batch of sequences its own blocks."""

    anchors: torch.Tensor  # [nblocks] (every row alike) or [b, nblocks], long
    block_size: int
    kernel: str = "blocks"  # one of KERNELS; flex and compiled run only where gradients are taken (else blocks)
    capacity: int = 0  # flex: context positions padded to this many (fixed shapes compile once); 0: S, rounded
    flex_mask: object = field(default=None, init=False, repr=False, compare=False)  # built once, for every layer
    hidden: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # `hidden_context`


def block_attention(q, ctx_k, ctx_v, k, v, layout: BlockLayout) -> torch.Tensor:
    """Attention under `layout` by its kernel, [b, H, N, d]. A pass without gradients (held-out evaluation, decoded
    anchors) always takes `blocks`: a compiled forward alone would be one more compile."""
    if layout.kernel == "flex" and torch.is_grad_enabled():
        return flex_block_attention(q, ctx_k, ctx_v, k, v, layout)
    if layout.kernel == "compiled":  # called from a compiled layer: opaque to the compiler
        return opaque_block_sparse_attention(q, ctx_k, ctx_v, k, v, layout)
    return block_sparse_attention(q, ctx_k, ctx_v, k, v, layout)


def block_sparse_attention(q, ctx_k, ctx_v, k, v, layout: BlockLayout) -> torch.Tensor:
    """Attention under `layout` in O(N * (S + B)): scores against the context (hidden from each block's anchor on)
    and against the block's own B keys, one softmax over both. Equals SDPA with the dense block mask.
    q [b, H, N, d]; ctx_k, ctx_v [b, KV, S, d]; k, v [b, KV, N, d]; a query head h uses key/value head h // (H/KV).
    Returns [b, H, N, d], in autocast's dtype where it is on (the products' dtype), else q's."""
    device_type = q.device.type
    dtype = torch.get_autocast_dtype(device_type) if autocasting(device_type) else q.dtype
    with autocast_off(device_type):
        return BlockSparseAttention.apply(q, ctx_k, ctx_v, k, v, hidden_context(layout, ctx_k.shape[2]),
                                          layout.block_size, dtype)


def hidden_context(layout: BlockLayout, context: int) -> torch.Tensor:
    """The context scores each query may not see (positions from its block's anchor on), bool [N, S] or
    [b, 1, 1, N, S]; made once a pass, for every layer, as the flex mask is."""
    if layout.hidden is None or layout.hidden.shape[-1] != context:
        per_query = layout.anchors.repeat_interleave(layout.block_size, dim=-1)
        hidden = torch.arange(context, device=per_query.device) >= per_query[..., None]
        layout.hidden = hidden[:, None, None] if hidden.dim() == 3 else hidden
    return layout.hidden


class BlockSparseAttention(torch.autograd.Function):
    """`block_sparse_attention` with a backward pass of its own, for the bytes: the [b, H, N, S + B] scores are a
    step's largest tensors on a GPU (~1 GB each in bfloat16 at 8 sequences x 512 anchors), and torch's operations
    passed over them ~25 times a layer, forward and backward (scripts/step_traffic.py). Here the scores are written
    straight into one [.., S + B] buffer (no concatenation, no slices to stitch back in the backward pass), and the
    masked scores need no backward of their own: their probabilities are exactly 0, so the softmax's backward
    already gives them a 0 gradient. About 13 passes a layer. A query head's group shares its key/value head, so the
    group's queries are rows of one product (no keys repeated per head)."""

    @staticmethod
    def forward(ctx, q, ctx_k, ctx_v, k, v, hidden, block_size: int, dtype: torch.dtype):
        b, heads, n, d = q.shape
        kv_heads, s = ctx_k.shape[1], ctx_k.shape[2]
        group, nblocks = heads // kv_heads, n // block_size
        qs = (q.reshape(b * kv_heads, group * n, d) * d**-0.5).to(dtype)  # a group's queries as rows
        ctx_k, ctx_v = ctx_k.reshape(b * kv_heads, s, d).to(dtype), ctx_v.reshape(b * kv_heads, s, d).to(dtype)
        k, v = k.to(dtype), v.to(dtype)
        scores = qs.new_empty(b * kv_heads, group * n, s + block_size)
        torch.bmm(qs, ctx_k.transpose(1, 2), out=scores[..., :s])
        scores[..., s:] = own_products(qs, k, group, nblocks, block_size)
        scores5 = scores.view(b, kv_heads, group, n, s + block_size)
        scores5[..., :s].masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(-1)  # in the scores' dtype; the kernels sum in float32
        del scores, scores5
        out = torch.bmm(probs[..., :s], ctx_v)
        out += own_values(probs[..., s:], v, group, nblocks, block_size)
        ctx.save_for_backward(qs, ctx_k, ctx_v, k, v, probs)
        ctx.shape = (b, heads, n, d, group, nblocks, block_size)
        return out.view(b, heads, n, d)

    @staticmethod
    def backward(ctx, grad_out):
        qs, ctx_k, ctx_v, k, v, probs = ctx.saved_tensors
        b, heads, n, d, group, nblocks, size = ctx.shape
        kv_heads, s = k.shape[1], ctx_k.shape[1]
        grad_out = grad_out.reshape(b * kv_heads, group * n, d).to(probs.dtype)
        grad_probs = torch.empty_like(probs)
        torch.bmm(grad_out, ctx_v.transpose(1, 2), out=grad_probs[..., :s])
        grad_probs[..., s:] = own_products(grad_out, v, group, nblocks, size)
        grad_ctx_v = torch.bmm(probs[..., :s].transpose(1, 2), grad_out)
        grad_v = own_keys_grad(probs[..., s:], grad_out, b, kv_heads, group, nblocks, size)
        # hidden scores: probability 0, so their gradient is 0 here with no mask
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        del grad_probs
        grad_q = torch.bmm(grad_scores[..., :s], ctx_k)
        grad_q += own_values(grad_scores[..., s:], k, group, nblocks, size)
        grad_ctx_k = torch.bmm(grad_scores[..., :s].transpose(1, 2), qs)
        grad_k = own_keys_grad(grad_scores[..., s:], qs, b, kv_heads, group, nblocks, size)
        grad_q = grad_q.view(b, heads, n, d) * d**-0.5
        return (grad_q, grad_ctx_k.view(b, kv_heads, s, d), grad_ctx_v.view(b, kv_heads, s, d), grad_k, grad_v,
                None, None, None)


def opaque_block_sparse_attention(q, ctx_k, ctx_v, k, v, layout: BlockLayout) -> torch.Tensor:
    """`block_sparse_attention`, which torch.compile calls as it is instead of tracing (its products write into
    slices of one buffer, and its backward pass is already what a compiler would make of it)."""
    if _opaque_attention is None:  # an eager caller; a compiled layer made it before its first trace
        make_attention_opaque()
    return _opaque_attention(q, ctx_k, ctx_v, k, v, layout)


_opaque_attention = None


def make_attention_opaque() -> None:
    """Wraps `block_sparse_attention` for the compiler, on first use: torch.compiler.disable imports the compiler
    (about a second). Called before the compiler traces a layer, which then reads a plain global: a cached
    function called inside a trace draws dynamo's lru_cache warning."""
    global _opaque_attention
    if _opaque_attention is None:
        _opaque_attention = torch.compiler.disable(block_sparse_attention)


def own_products(rows, keys, group: int, nblocks: int, size: int) -> torch.Tensor:
    """Each query row against its own block's keys: rows [b*KV, group*N, d], keys [b, KV, N, d] ->
    [b*KV, group*N, size]."""
    bkv, _, d = rows.shape
    blocked = rows.view(bkv, group, nblocks, size, d)
    own = keys.reshape(bkv, 1, nblocks, size, d).transpose(-1, -2)
    return (blocked @ own).view(bkv, group * nblocks * size, size)


def own_values(weights, values, group: int, nblocks: int, size: int) -> torch.Tensor:
    """Each row's weights over its own block's `size` rows of `values` [b, KV, N, d] (or [b*KV, N, d]):
    weights [b*KV, group*N, size] -> [b*KV, group*N, d]."""
    bkv, d = weights.shape[0], values.shape[-1]
    blocked = weights.reshape(bkv, group, nblocks, size, size)
    return (blocked @ values.reshape(bkv, 1, nblocks, size, d)).view(bkv, group * nblocks * size, d)


def own_keys_grad(weights, rows, b: int, kv_heads: int, group: int, nblocks: int, size: int) -> torch.Tensor:
    """The gradient a block's own keys (or values) get from the rows that read them, summed over a head's group:
    weights [b*KV, group*N, size], rows [b*KV, group*N, d] -> [b, KV, N, d]."""
    d = rows.shape[-1]
    blocked = weights.reshape(b * kv_heads, group, nblocks, size, size).transpose(-1, -2)
    grad = blocked @ rows.reshape(b * kv_heads, group, nblocks, size, d)  # [bKV, group, nblocks, size, d]
    return grad.sum(1).view(b, kv_heads, nblocks * size, d)


def autocasting(device_type: str) -> bool:
    """Whether autocast is on for this device type (never on a device autocast does not know, such as meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """A context with autocast off where it is on."""
    return torch.autocast(device_type, enabled=False) if autocasting(device_type) else nullcontext()


# ---- FlexAttention -------------------------------------------------------------------------------------------------
def flex_unavailable(device: torch.device) -> str:
    """Why `flex` cannot train on `device` ("" where it can)."""
    return cuda_with(device, "torch.nn.attention.flex_attention", "this torch has no FlexAttention",
                     "FlexAttention trains on CUDA only (it has no CPU backward pass)")


def compiled_unavailable(device: torch.device) -> str:
    """Why `compiled` is not among the kernels `auto` times on `device` ("" where it is)."""
    return cuda_with(device, "triton", "torch.compile needs triton (inductor's GPU code generator) on a GPU",
                     "the compiled layers are timed on CUDA only (on a CPU the products bound a step: 6% in float32)")


def compiled_cannot_run(device: torch.device) -> str:
    """Why `--attention compiled` cannot run on `device` at all ("" where it can): inductor builds C++ on a CPU and
    triton kernels on a GPU."""
    if torch.device(device).type == "cuda":
        return compiled_unavailable(device)
    if not any(shutil.which(name) for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if name):
        return "torch.compile needs a C++ compiler on a CPU (g++, clang++ or $CXX); none was found"
    return ""


def cuda_with(device: torch.device, module: str, missing: str, not_cuda: str) -> str:
    """"" where `device` is CUDA and `module` imports, else why not."""
    if torch.device(device).type != "cuda":
        return not_cuda
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{missing} ({exc})"
    return ""


_compiled_flex = None


def compiled_flex():
    """flex_attention compiled once per process: uncompiled it runs a dense reference that materialises the
    scores. Static shapes: the layout pads them (`flex_block_attention`), so steps share one graph."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def padded_capacity(layout: BlockLayout, context: int) -> int:
    """Context positions the flex kernel sees: the layout's capacity (at least the context), in whole tiles, so
    that a tile of keys is all context or all block keys."""
    return -(-max(layout.capacity, context) // TILE) * TILE


def flex_block_attention(q, ctx_k, ctx_v, k, v, layout: BlockLayout, flex=None) -> torch.Tensor:
    """`block_sparse_attention` by FlexAttention: keys are the context padded to `padded_capacity`, then every
    block's own keys; `flex_block_mask` says which tiles to compute. `flex`: the attention function (default the
    compiled one; tests pass the eager reference). Under autocast every input goes to its dtype first: RoPE leaves q
    and k in float32 while v comes out of a bfloat16 product, and the kernel wants one dtype."""
    b, heads, n, _ = q.shape
    kv_heads, s = ctx_k.shape[1], ctx_k.shape[2]
    capacity = padded_capacity(layout, s)
    device_type = q.device.type
    dtype = torch.get_autocast_dtype(device_type) if autocasting(device_type) else q.dtype
    pad = (0, 0, 0, capacity - s)
    keys = torch.cat([F.pad(ctx_k.to(dtype), pad), k.to(dtype)], dim=2)
    values = torch.cat([F.pad(ctx_v.to(dtype), pad), v.to(dtype)], dim=2)
    if layout.flex_mask is None:  # the same for every layer of the pass
        layout.flex_mask = flex_block_mask(layout.anchors, layout.block_size, b, n, capacity)
    mask = layout.flex_mask
    with autocast_off(device_type):
        return (flex or compiled_flex())(q.to(dtype), keys, values, block_mask=mask, enable_gqa=heads != kv_heads)


def flex_block_mask(anchors: torch.Tensor, block_size: int, batch: int, queries: int, capacity: int):
    """The BlockMask of a layout whose keys are `capacity` context positions (a multiple of TILE; positions past the
    real context are padding no anchor reaches) followed by the `queries` block tokens' own keys.

    Built from the anchors with tensor operations on their device, so nothing waits for a GPU. Per tile of TILE
    queries (TILE / block_size blocks of sorted anchors, so their anchors lie close together), a context tile is
    full where it ends at or before the tile's lowest anchor, partial where it starts before its highest, skipped
    otherwise; the tiles holding the tile's own block keys are partial. Partial tiles apply `mask_mod`, per query
    and key."""
    from torch.nn.attention.flex_attention import BlockMask

    device = anchors.device
    per_query = (anchors if anchors.dim() == 2 else anchors.expand(batch, -1)).repeat_interleave(block_size, dim=-1)
    q_tiles, kv_tiles = -(-queries // TILE), (capacity + queries + TILE - 1) // TILE
    spare = q_tiles * TILE - queries
    lowest = F.pad(per_query, (0, spare), value=capacity).view(batch, q_tiles, TILE).amin(-1)[..., None]
    highest = F.pad(per_query, (0, spare), value=0).view(batch, q_tiles, TILE).amax(-1)[..., None]
    starts = torch.arange(kv_tiles, device=device) * TILE  # first key of each key tile
    in_context = starts < capacity
    full = in_context & (starts + TILE <= lowest)  # [b, q_tiles, kv_tiles]
    seen = in_context & (starts < highest)
    first_query = torch.arange(q_tiles, device=device) * TILE
    last_query = (first_query + TILE).clamp(max=queries) - 1
    own_from = capacity + first_query // block_size * block_size  # the tile's own block keys, [from, to)
    own_to = capacity + (last_query // block_size + 1) * block_size
    own = ~in_context & (starts < own_to[:, None]) & (starts + TILE > own_from[:, None])  # [q_tiles, kv_tiles]
    partial = (seen & ~full) | own

    # mask_mod reads each query's anchor; padded to whole tiles (the kernel may ask for a query past the last)
    query_anchor = F.pad(per_query, (0, spare), value=0)

    def mask_mod(b, h, q_idx, kv_idx):
        in_own_block = (kv_idx - capacity) // block_size == q_idx // block_size
        return torch.where(kv_idx < capacity, kv_idx < query_anchor[b, q_idx], in_own_block)

    counts, indices = tiles_in_order(partial)
    full_counts, full_indices = tiles_in_order(full)
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=(queries, capacity + queries))


def tiles_in_order(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [b, q_tiles, kv_tiles] tile mask as BlockMask's (counts [b, 1, q_tiles], indices [b, 1, q_tiles,
    kv_tiles]): each query tile's key tiles to compute first, in order."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]
