"""Inference matmuls on CPU through oneDNN, with each frozen weight laid out ("packed") for it once.

Why: PyTorch sends a float32 `nn.Linear` on CPU to MKL's sgemm. On the AMD EPYC we develop on, for the 1 to 17 rows
of decoding and verification, that path ran SmolLM2-135M's forward in 43 ms for one token and 85 ms for sixteen
(with features); with the same weights packed for oneDNN it took 24 and 36 ms (`scripts/profile_round.py float32`,
2 threads, with and without DFLASH_PACKED=0). bfloat16 linears already run through oneDNN but re-layout the weight
on every call; packing halves their few-row cost as well.

Only for weights that no longer change (a frozen target, a loaded drafter): the packed copy is made once and would
go stale if the weight were trained. Anything the packed kernel does not cover (autograd, another device, a dtype
other than the weight's, a PyTorch build without oneDNN) falls back to `F.linear`, so the original weights stay
and the packed copies double the memory of the linears: `DFLASH_PACKED=0` turns the packing off where memory is
tight (a large target on CPU) or to compare against the plain path.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
ROWS_HINT = 16  # oneDNN picks its weight layout for about this many rows: a verify pass of a block of 16
# bf16 products of more rows (prefill, training features) ran slower packed than through F.linear's own oneDNN call
# (1536x576 weight, 2048 rows: 15 vs 8 ms); float32 ones ran faster packed at every size we timed (1 to 512 rows)
BF16_MAX_PACKED_ROWS = 64


def packing_enabled() -> bool:
    return (
        os.environ.get("DFLASH_PACKED", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The oneDNN layout of `weight`, or None where packing is off, unsupported, or disagrees with F.linear."""
    if not packing_enabled() or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
        # a cheap guard against a build whose kernel misbehaves: two rows must match the reference product
        probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
        expected = F.linear(probe, weight, bias).float()
        if not torch.allclose(_packed_product(probe, packed, bias).float(), expected, rtol=tolerance, atol=tolerance):
            return None
        return packed
    except RuntimeError:
        return None


class FrozenLinear:
    """y = x W^T (+ b) for a weight that never changes again: the packed oneDNN kernel where it applies."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        with torch.no_grad():
            self.packed = _pack(self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.packed is None
            or x.dtype != self.weight.dtype
            or x.device.type != "cpu"
            or (x.requires_grad and torch.is_grad_enabled())
            or (x.dtype == torch.bfloat16 and x.numel() > BF16_MAX_PACKED_ROWS * x.shape[-1])
        ):
            return F.linear(x, self.weight, self.bias)
        return _packed_product(x, self.packed, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Route every `nn.Linear` of a frozen `model` through `FrozenLinear`; returns how many got a packed weight.
    Call it after the last `.to(dtype/device)`: a later move would leave the packed copies behind."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            frozen = FrozenLinear(module.weight, module.bias)
            module.forward = frozen  # an instance attribute: nn.Module.__call__ (and its hooks) still run
            count += frozen.packed is not None
    return count
