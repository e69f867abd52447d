"""Which of PyTorch's attention kernels (SDPA backends) our eager passes use on a CUDA device, chosen by measurement.

Why: on a lent H100 (torch 2.11, CUDA 13) SDPA picked cuDNN's attention for every eager call, and cuDNN builds an
execution plan per shape. Decoding meets a new shape at every call (each step attends to one more key; each
drafter round to a longer context), so each call paid 1-2 ms of host time for ~4 us of GPU work (torch.profiler,
docs/RESULTS.md, twenty-seventh session): 30 layers made an eager step 38 ms against 2.8 ms as a CUDA graph, and
the drafter, which always runs eagerly, paid it too. Whether another backend is faster depends on the GPU, the
torch build and the head shapes, so nothing here is a constant: `measure` times each candidate on fresh shapes, the
way decoding meets them (a benchmark of one repeated shape hides the per-shape cost), and `choose` keeps the
fastest. The choice applies to attention calls on that device only (`attention`, which layers.Attention.attend
calls); where none was made (every CPU) the call goes straight to torch.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# name -> backends in priority order (a listed backend that cannot take a call falls through to the next);
# "default" is torch's own choice
CANDIDATES: dict[str, tuple[SDPBackend, ...] | None] = {
    "default": None,
    "flash": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH),
    "math": (SDPBackend.MATH,),
}
VERIFY_WIDTH = 16  # the masked calls: a verify pass's or a drafter block's queries

_chosen: dict[torch.device, tuple[SDPBackend, ...]] = {}  # device -> the backends its attention calls run under


class _Causal:
    """Passed as an attention mask: every query i sees keys 0..i, queries and keys counted from the same first
    position (a prefill into an empty cache). SDPA then runs with `is_causal`, which skips the scores above the
    diagonal instead of reading a [queries, keys] mask of bools and computing them all: on 2 Zen 4 cores a
    1024-token bfloat16 call took half the time with the same outputs, bitwise (docs/RESULTS.md,
    thirty-fifth session)."""

    def __repr__(self) -> str:
        return "CAUSAL"


CAUSAL = _Causal()


def bool_mask(mask, queries: int, keys: int, device: torch.device) -> torch.Tensor | None:
    """`mask` as bools [queries, keys] where it is CAUSAL (for attention SDPA cannot run), otherwise unchanged."""
    if mask is not CAUSAL:
        return mask
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril()


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, under the backends chosen for q's device (none chosen: torch's own).
    `mask`: bools (True = may attend), None (every key visible) or CAUSAL."""
    causal = mask is CAUSAL
    mask = None if causal else mask
    backends = _chosen.get(q.device) if _chosen else None
    if backends is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=enable_gqa)
    with sdpa_kernel(list(backends), set_priority=True):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=enable_gqa)


def use(device: torch.device, name: str) -> None:
    """Run attention on `device` under candidate `name` from now on ("default": torch's own choice)."""
    if name not in CANDIDATES:
        raise ValueError(f"unknown SDPA candidate {name!r}; one of {', '.join(CANDIDATES)}")
    backends = CANDIDATES[name]
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # tensors name their device with its index
        device = torch.device("cuda", torch.cuda.current_device())
    if backends is None:
        _chosen.pop(device, None)
    else:
        _chosen[device] = backends


def _calls(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, first_length: int,
           calls: int):
    """Attention calls shaped like decoding's, each at a length not seen before: a one-query step, then a masked
    block of VERIFY_WIDTH queries, alternately."""
    gqa = heads != kv_heads
    for i in range(calls):
        length = first_length + i
        width = 1 if i % 2 == 0 else VERIFY_WIDTH
        q = torch.randn(1, heads, width, head_dim, device=device, dtype=dtype)
        k = torch.randn(1, kv_heads, length + width, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        mask = None
        if width > 1:  # causal within the block, all of the context before it
            mask = (torch.arange(length + width, device=device) <= length + torch.arange(width, device=device)[:, None])
            mask = mask[None, None]
        yield q, k, v, mask, gqa


def measure(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, calls: int = 16,
            timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per call, over `calls` decoding-shaped attention calls, under each candidate (one none of whose
    backends can take these calls is left out). Each candidate first warms up at a length of its own (library
    handles, lazy initialisation), then meets fresh lengths."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds: dict[str, float] = {}
    for index, (name, backends) in enumerate(CANDIDATES.items()):
        context = (lambda: contextlib.nullcontext()) if backends is None else (
            lambda b=backends: sdpa_kernel(list(b), set_priority=True))
        first = 64 + index * 4 * calls  # lengths no other candidate met (a plan cache is shared by all)
        try:
            with torch.inference_mode(), context():
                for q, k, v, mask, gqa in _calls(device, dtype, heads, kv_heads, head_dim, first - 2 * calls, 2):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
                inputs = list(_calls(device, dtype, heads, kv_heads, head_dim, first, calls))
                sync()
                start = timer()
                for q, k, v, mask, gqa in inputs:
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
                sync()
                seconds[name] = (timer() - start) / calls
        except RuntimeError:  # "No available kernel": none of its backends takes GQA or masks here
            continue
    return seconds


def choose(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
           seconds: dict[str, float] | None = None) -> dict:
    """Measure (unless `seconds` is given), use the fastest candidate on `device`, and return a report for the
    bench's JSON: the choice and each candidate's milliseconds per call (`seconds`: per call, as `measure`'s)."""
    if seconds is None:
        seconds = measure(device, dtype, heads, kv_heads, head_dim)
    if not seconds:
        return {"sdpa": "default", "measured": False}
    best = min(seconds, key=seconds.get)
    use(device, best)
    return {"sdpa": best, "measured": True, "ms_per_call": {k: round(1e3 * s, 4) for k, s in seconds.items()}}
