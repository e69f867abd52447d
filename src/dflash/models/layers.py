"""Building blocks shared by every model dflash runs: the lean target forward, the DFlash drafter and the EAGLE-3
head. Module and weight names follow Hugging Face's Llama/Qwen3 layout (`q_proj`, `k_norm`, `gate_proj`, ...), so
checkpoints load by name and the drafter's state dict is exactly the public DFlash format.

Attention is split into its steps (project, attend, output) rather than one forward, because the three models wire
keys and values differently: the target writes them into its KV cache, the drafter puts the keys of the injected
target features in front of its block's own, the EAGLE-3 head attends along its draft chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import native, sdpa_backends
from .kernels import FrozenLinear, products_changed


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in float32. `unit_offset` is Gemma's variant: the stored weight is
    an offset from 1 and the product is taken in float32 before casting back (Llama casts first); both orders are
    kept so bf16 outputs round as Hugging Face's do."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:  # one fused op, bitwise equal to the steps below
            weight = 1.0 + self.weight if self.unit_offset else self.weight
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward without gradients, in one C call on the CPU where it can run (native.rms_norm): a model's final
        norm, and drafters' norms when drafting. torch's bfloat16 norm is six small ops, each cold after a pass
        (~0.2 ms of a 7 ms SmolLM2 step). The same function for every call of a model (x made contiguous; the C
        call's conditions are the model's dtype and device), so a row normed in a step is bitwise the row normed in
        a verify pass."""
        x = x.contiguous()
        out = native.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return out if out is not None else self(x)


# ---- rotary position embedding ----------------------------------------------------------------------------------
def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_parameters(config, layer_type: str = "full_attention") -> dict:
    """The RoPE parameters of one layer type: Gemma3 keeps one dict per layer type, other models one dict (or the
    legacy `rope_theta` / `rope_scaling` attributes)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    elif any(isinstance(v, dict) for v in params.values()):
        params = next(v for v in params.values() if isinstance(v, dict))
    params = dict(params)
    params.setdefault("rope_type", (getattr(config, "rope_scaling", None) or {}).get("rope_type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_theta(config, layer_type: str = "full_attention") -> float:
    """The RoPE base of `layer_type` layers; drafters take that of the target's full-attention layers."""
    return float(rope_parameters(config, layer_type)["rope_theta"])


# RoPE types whose frequencies do not depend on the sequence length, so a position's cos/sin never changes
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class Rotary(nn.Module):
    """cos/sin of absolute positions for one set of inverse frequencies (Hugging Face's formula, float32)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    @classmethod
    def with_theta(cls, head_dim: int, theta: float) -> "Rotary":
        return cls(default_inv_freq(head_dim, theta))

    @classmethod
    def for_config(cls, config, head_dim: int, layer_type: str = "full_attention") -> "Rotary":
        """The target's own RoPE for `layer_type` (scaled types through transformers' initialisers)."""
        params = rope_parameters(config, layer_type)
        kind = params["rope_type"]
        if kind not in STATIC_ROPE_TYPES:
            raise NotImplementedError(f"RoPE type {kind!r} depends on the sequence length")
        if kind == "default":
            return cls.with_theta(head_dim, float(params["rope_theta"]))
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu", layer_type=layer_type) if _has_layer_types(
            config) else ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        return cls(inv_freq, float(scaling))

    def spans(self, starts: list[int], n: int, positions: torch.Tensor | None, dtype: torch.dtype,
              in_order: bool = True, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(positions) where row r's positions are starts[r] + 0..n-1 (`positions` holds them; `in_order`
        False: any positions below starts[r] + n, as a tree pass's depths), read from a
        table of every position up to the furthest asked so far: a decode step computed its cos/sin anew with ~10
        small ops. Each position's values are the ones `forward` computes for it (elementwise ops, so where a
        position sits in the call does not matter), and the same in every pass. One row in order reads a slice of
        the table: `positions` may then be None (`device` says where)."""
        end = max(starts) + n
        device = positions.device if positions is not None else device
        tables = self.__dict__.setdefault("_tables", {})
        key = (dtype, device)
        if key not in tables or tables[key][0].shape[0] < end:
            size = max(256, 1 << (end - 1).bit_length())  # doubling: a long generation re-makes it a few times
            cos, sin = self(torch.arange(size, device=device)[None], dtype)
            tables[key] = (cos[0], sin[0])  # [size, 1, head_dim]
        cos, sin = tables[key]
        if len(starts) == 1 and in_order:  # a view: rows of the table are contiguous
            return cos[starts[0]: end][None], sin[starts[0]: end][None]
        if positions is None:
            positions = torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)
        return cos[positions], sin[positions]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [batch, seq, 1, head_dim], for `positions` [batch, seq], in `dtype`; the sin's
        first half is negated so that `apply_rotary` needs one roll instead of rotate_half's slices and cat."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        cos = torch.cat((cos, cos), dim=-1)[:, :, None]
        sin = torch.cat((-sin, sin), dim=-1)[:, :, None]
        return cos.to(dtype), sin.to(dtype)


def _has_layer_types(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return any(isinstance(v, dict) for v in params.values())


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (Hugging Face's convention) for x [batch, seq, heads, head_dim]: rolling x by
    half a head and multiplying by the signed sin gives rotate_half(x) * sin exactly, in one op fewer than three."""
    cos, signed_sin = rope
    if cos.dtype != x.dtype:  # under autocast the projections may come out in another dtype than the table
        cos, signed_sin = cos.to(x.dtype), signed_sin.to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# ---- attention --------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Grouped-query attention projections (Llama, Qwen3 with per-head q/k norms, Gemma3), in three steps:
    `project` gives rotated queries and keys and the values of new tokens, `attend` mixes them with whatever keys
    the caller assembled, `output` projects back. `context_kv` projects injected features (the DFlash drafter).

    `freeze()` prepares inference: q/k/v become one fused product (and k/v one for injected context) through the
    machine's chosen matmul kernel. Trainable models keep the separate `nn.Linear`s."""

    def __setattr__(self, name, value):
        if isinstance(value, FrozenLinear):  # a product set into the block (kernels.products_generation)
            products_changed()
        super().__setattr__(name, value)

    def __init__(self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, out_features: int,
                 qk_norm: bool = False, eps: float = 1e-6, bias: bool = False, out_bias: bool | None = None,
                 norm_unit_offset: bool = False, scale: float | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_features, bias=bias if out_bias is None else out_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, eps, norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: FrozenLinear | None = None
        self.kv: FrozenLinear | None = None
        self.o_fast: FrozenLinear | None = None

    def freeze(self, plan=None, context: bool = False) -> None:
        """Fuse the projections for inference; `context`: also k/v for injected context (the drafter)."""
        self.qkv = FrozenLinear.fused([self.q_proj, self.k_proj, self.v_proj], plan)
        self.kv = FrozenLinear(torch.cat([self.k_proj.weight, self.v_proj.weight]).detach(), _cat_bias(
            [self.k_proj, self.v_proj]), plan) if context else None
        self.o_fast = FrozenLinear.of(self.o_proj, plan)

    def project(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, H, s, d], k and v [b, KV, s, d] of tokens `x` [b, s, in]; RoPE applied to q and k."""
        b, s, _ = x.shape
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        if self.qkv is not None:
            fused = self.qkv(x).view(b, s, heads + 2 * kv_heads, d)
            qk, v = fused[:, :, : heads + kv_heads], fused[:, :, heads + kv_heads:]
            if self.q_norm is None:  # q and k sit side by side: rotate both in one go
                qk = apply_rotary(qk, rope)
                return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        else:
            q = self.q_proj(x).view(b, s, heads, d)
            k = self.k_proj(x).view(b, s, kv_heads, d)
            v = self.v_proj(x).view(b, s, kv_heads, d)
        if self.q_norm is not None:  # per head, in the [b, s, heads, d] layout (Qwen3's order)
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, rope).transpose(1, 2), apply_rotary(k, rope).transpose(1, 2), v.transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of injected context `ctx` [b, s, in] with this layer's own projections."""
        b, s, _ = ctx.shape
        if self.kv is not None:
            k, v = self.kv(ctx).view(b, s, 2 * self.kv_heads, self.head_dim).split(self.kv_heads, 2)
        else:
            k = self.k_proj(ctx).view(b, s, self.kv_heads, self.head_dim)
            v = self.v_proj(ctx).view(b, s, self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, rope).transpose(1, 2), v.transpose(1, 2)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """softmax(q k^T * scale [masked]) v -> [b, s, H * d]. mask: bool, True = may attend, broadcastable to
        [b, H, s, keys]; or sdpa_backends.CAUSAL (queries and keys from the same first position)."""
        if softcap is None:
            out = sdpa_backends.attention(q, keys, values, mask, self.scale, self.heads != self.kv_heads)
        else:
            out = softcapped_attention(q, keys, values, mask, self.scale, softcap)
        b, _, s, _ = out.shape
        return out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_fast(attended) if self.o_fast is not None else self.o_proj(attended)


def _cat_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                      for lin in linears])


def softcapped_attention(q, keys, values, mask, scale: float, softcap: float) -> torch.Tensor:
    """Attention with tanh-capped logits (Gemma2-style `attn_logit_softcapping`), which SDPA cannot express."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    mask = sdpa_backends.bool_mask(mask, q.shape[2], keys.shape[2], q.device)
    scores = torch.tanh((q @ keys.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ values


# ---- feed-forward -----------------------------------------------------------------------------------------------
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `freeze()` fuses gate and up into one product for inference."""

    def __setattr__(self, name, value):
        if isinstance(value, FrozenLinear):  # a product set into the block (kernels.products_generation)
            products_changed()
        super().__setattr__(name, value)

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise NotImplementedError(f"MLP activation {activation!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation
        self.gate_up: FrozenLinear | None = None
        self.down_fast: FrozenLinear | None = None

    def freeze(self, plan=None) -> None:
        self.gate_up = FrozenLinear.fused([self.gate_proj, self.up_proj], plan)
        self.down_fast = FrozenLinear.of(self.down_proj, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS[self.activation]
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_fast(act(gate) * up)
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


def causal_mask(query_positions: torch.Tensor, key_count: int, window: int | None = None) -> torch.Tensor:
    """Bool [b, 1, s, key_count]: key j is visible to a query at position p iff j <= p (and p - j < window)."""
    keys = torch.arange(key_count, device=query_positions.device)
    visible = keys <= query_positions[..., None]
    if window is not None:
        visible &= keys > query_positions[..., None] - window
    return visible[:, None]



GATES = {"silu": False, "swish": False, "gelu_pytorch_tanh": True, "gelu_new": True}  # activation -> C's `gelu`


def native_constants(owner: nn.Module, attn: Attention, mlp: GatedMLP, norm1: RMSNorm, norm2: RMSNorm,
                     dtype: torch.dtype, tokens: int, sandwich: tuple[RMSNorm, RMSNorm] | None = None,
                     window: int | None = None, rope: int = 0) -> tuple | None:
    """A pre-norm decoder layer's constant arguments for native.c (native.layer_constants), made once per weight
    state and kept on `owner` (key: the products' signatures, so a moved, cast or rewritten weight re-makes them, as
    FrozenLinear re-lays its copies out); None unless the plan picked our kernel for every product at this many
    rows and the layer is one C runs: a SiLU or GELU-tanh MLP without biases, norms of one epsilon, all with or all
    without Gemma's unit offset. norm1 comes before attention and norm2 before the MLP; Gemma3's `sandwich` norms
    after each; `window`: a sliding window; `rope`: which of the model's RoPE tables the layer reads."""
    products = (attn._modules.get("qkv"), attn._modules.get("o_fast"), mlp._modules.get("gate_up"),
                mlp._modules.get("down_fast"))  # per call: plain dict lookups, not __getattr__
    if any(lin is None or lin.kernel_for_rows(tokens) != "native" for lin in products):
        return None
    key = (dtype, native._pairs, native._int8_on, window, rope, tuple(lin._signature() for lin in products))
    cached = owner.__dict__.get("_native_cache")
    if cached is not None and cached[0] == key:
        return cached[1]
    weights = _native_weights(attn, mlp, norm1, norm2, dtype, sandwich)
    constants = None
    if weights is not None:
        shape = {"eps": norm1.eps, "qk_eps": attn.q_norm.eps if attn.q_norm is not None else 0.0,
                 "hidden": attn.o_fast.out_features, "heads": attn.heads, "kv_heads": attn.kv_heads,
                 "head_dim": attn.head_dim, "intermediate": mlp.down_fast.in_features, "scale": attn.scale,
                 "gemma": norm1.unit_offset, "gelu": GATES[mlp.activation], "window": window, "rope": rope}
        constants = native.layer_constants(weights, shape, dtype)
    owner.__dict__["_native_cache"] = (key, constants, weights)  # weights: keeps what the pointers point to
    return constants


def _native_weights(attn: Attention, mlp: GatedMLP, norm1: RMSNorm, norm2: RMSNorm, dtype: torch.dtype,
                    sandwich: tuple[RMSNorm, RMSNorm] | None = None) -> dict | None:
    layer_norms = [norm1, norm2, *(sandwich or ())]
    if (mlp.activation not in GATES or mlp.gate_up.bias is not None or mlp.down_fast.bias is not None
            or any(n.eps != norm1.eps for n in layer_norms)):
        return None
    products = {"qkv": attn.qkv, "o": attn.o_fast, "gate_up": mlp.gate_up, "down": mlp.down_fast}
    weights = {name: lin.native_tiles() for name, lin in products.items()}
    norms = layer_norms + ([attn.q_norm, attn.k_norm] if attn.q_norm is not None else [])
    weights.update(norm1=norm1.weight, norm2=norm2.weight, qkv_bias=attn.qkv.bias, o_bias=attn.o_fast.bias,
                   q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
                   k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
                   norm3=sandwich[0].weight if sandwich else None, norm4=sandwich[1].weight if sandwich else None)
    int8 = [weights[name].dtype == torch.int8 for name in products if weights[name] is not None]
    if any(n.unit_offset != norm1.unit_offset for n in norms) or any(
            w is None or native.tiles_dtype(w) != dtype or not w.is_contiguous()
            for name, w in weights.items() if w is not None or name in products) or 0 < sum(int8) < len(products):
        return None  # (int8 tiles: all four products or none)
    return weights
