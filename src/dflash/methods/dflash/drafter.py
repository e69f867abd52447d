"""The DFlash drafter: a few Qwen3-style layers that denoise a block of masked tokens in one pass.

Target features (outputs of chosen target layers) are fused once per call, ctx = RMSNorm(fc([h_1; ...; h_n])), and
injected as extra keys/values in EVERY layer: K_ctx = k_norm(k_proj(ctx)), V_ctx = v_proj(ctx), placed before the
block's own K/V. Queries come only from block tokens, so context never enters the residual stream. Inside the block
attention is bidirectional. Token embedding and LM head are the target's (frozen, not stored here).

At inference the context keys/values live in a position-indexed KVCache (models/cache.py): each call writes the new
context at the committed length and the block's own keys right after it, attends over both, and moves the length by
the context only, so the block's keys are overwritten next time.

The module and weight names follow the public checkpoint format (DFLASH_SPEC.md section 6) so that `state_dict()` is
exactly what vLLM / SGLang load. A folder may also hold `draft_vocab.json` ({"token_ids": [...]}, our addition, which
other loaders ignore): the target tokens the drafter may propose, the most frequent ones of its training responses.
Drafting then scores only those rows of the LM head, on a CPU most of a drafting pass's time.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from ...checkpoint import load_weights, read_folder, write_folder
from ...errors import UserError
from ...models import native
from ...models.cache import KVCache, scatter_index
from ...models.kernels import FrozenLinear
from ...models.layers import Attention, GatedMLP, RMSNorm, Rotary, native_constants
from ...models.transformer import MAX_NATIVE_TOKENS
from .attention import BlockLayout, block_attention, make_attention_opaque


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Feature layers spread uniformly over [1, L-3]: round(1 + i*(L-4)/(n-1)); one feature -> [L//2]."""
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_features - 1))) for i in range(num_features)]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    extra: dict = field(default_factory=dict)  # unknown keys of a loaded config.json, written back unchanged

    @classmethod
    def for_target(
        cls,
        target_config,
        vocab_size: int,
        mask_token_id: int,
        num_layers: int = 3,
        block_size: int = 16,
        num_features: int = 5,
        target_layer_ids: list[int] | None = None,
        kv_heads: int | None = None,
    ) -> "DFlashConfig":
        """A drafter shaped like the target (same width, heads and RoPE base) with `num_layers` layers and
        `kv_heads` key/value heads (default: the target's)."""
        from ..base import target_shape

        n_target = target_config.num_hidden_layers
        shape = target_shape(target_config)
        if kv_heads is not None:  # a random drafter may have any divisor; --init target checks its copy
            check_kv_heads(kv_heads, shape["num_attention_heads"])
            shape["num_key_value_heads"] = kv_heads
        return cls(
            **shape,
            num_hidden_layers=num_layers,
            vocab_size=vocab_size,
            num_target_layers=n_target,
            target_layer_ids=list(target_layer_ids or default_target_layer_ids(n_target, min(num_features, n_target))),
            mask_token_id=mask_token_id,
            block_size=block_size,
        )

    # ---- public format (a Qwen3 config.json plus the DFlash keys) ----------------------------------------------
    def to_hf_dict(self) -> dict:
        d = dict(self.extra)
        d.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            tie_word_embeddings=False,
            attention_bias=False,
            layer_types=["full_attention"] * self.num_hidden_layers,
            sliding_window=None,
            use_sliding_window=False,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DFlashConfig":
        try:
            dflash = d["dflash_config"]
            known = {f for f in cls.__dataclass_fields__ if f != "extra"}
            values = {k: d[k] for k in known if k in d}
            values["mask_token_id"] = dflash["mask_token_id"]
            values["target_layer_ids"] = list(dflash["target_layer_ids"])
            if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
                values["rope_theta"] = d["rope_parameters"].get("rope_theta", 10000.0)
            values.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
            values.setdefault("num_target_layers", max(values["target_layer_ids"]) + 1)
            extra = {k: v for k, v in d.items() if k not in known and k != "dflash_config"}
            return cls(**values, extra=extra)
        except (KeyError, TypeError) as exc:
            raise UserError(f"drafter config.json is not a DFlash config (missing or bad {exc})") from exc


def check_kv_heads(kv_heads: int, heads: int, current: int = 1) -> None:
    """Key/value heads a drafter may be given: a divisor of `heads`; one that starts from (is widened from, or
    copies) `current` heads must also be a multiple of them."""
    if kv_heads < 1 or heads % kv_heads or kv_heads % current:
        start = f" and be a multiple of {current} (the heads it starts from)" if current > 1 else ""
        raise UserError(f"kv_heads must divide the {heads} attention heads{start}, got {kv_heads}")


def repeat_kv_rows(weight: torch.Tensor, head_dim: int, factor: int) -> torch.Tensor:
    """A k/v projection's [kv * d, in] weight with each head's d rows repeated `factor` times (a new tensor): with
    heads // kv queries per key/value head, query head h reads head h // (heads // kv) before and
    h // (heads // (kv * factor)) after, which holds the same rows."""
    rows, width = weight.shape
    return weight.reshape(rows // head_dim, 1, head_dim, width).expand(-1, factor, -1, -1).reshape(-1, width)


# ---- the model -----------------------------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.hidden_size, qk_norm=True, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu")

    def forward(self, x, rope_block, ctx_k, ctx_v, mask, cache: KVCache | None = None, index: int = 0):
        """Block tokens `x` attend to the context keys/values and to each other. With a `cache` (inference) the
        context goes in at its length and the block's own keys right after, never committed."""
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(x), rope_block)
        if cache is not None:
            cache.write(index, ctx_k, ctx_v)
            keys, values = cache.write(index, k, v, offset=ctx_k.shape[2])
            out = attn.attend(q, keys, values)
        elif isinstance(mask, BlockLayout):
            out = block_attention(q, ctx_k, ctx_v, k, v, mask)
            out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        else:
            out = attn.attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)
        x = x + attn.output(out)
        return x + self.mlp(self.post_attention_layernorm(x))


@functools.cache
def compiled_layer_forward():
    make_attention_opaque()
    return torch.compile(DecoderLayer.forward)


def compiled_layer(layer: DecoderLayer, x, rope_block, ctx_k, ctx_v, layout: BlockLayout) -> torch.Tensor:
    """`layer(x, ...)` for a training pass, through torch.compile (the `compiled` training kernel,
    methods/dflash/attention.py): the norms, projections, RoPE and SwiGLU around the attention, which stays eager.
    The context's length changes every pass, so it is marked dynamic: one compile a layer serves every step."""
    for t in (ctx_k, ctx_v):
        torch._dynamo.mark_dynamic(t, 2)
    return compiled_layer_forward()(layer, x, rope_block, ctx_k, ctx_v, layout)


DRAFT_VOCAB_FILE = "draft_vocab.json"


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.draft_vocab: list[int] | None = None  # target ids it may propose; None: the whole vocabulary
        n_features = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary.with_theta(cfg.head_dim, cfg.rope_theta)

    @classmethod
    def untrained(cls, cfg: DFlashConfig, seed: int = 0) -> "DFlashDrafter":
        """A new drafter with N(0, 0.02) linear weights from a local generator (the global RNG is left alone)."""
        from ..base import init_untrained

        drafter = cls(cfg)
        init_untrained(drafter, seed)
        return drafter

    def with_kv_heads(self, kv_heads: int) -> "DFlashDrafter":
        """This drafter with `kv_heads` key/value heads (a multiple of its own) and the same outputs: each head is
        repeated, so training goes on from the same function with a wider path from the context into the block
        (its values are kv_heads * head_dim numbers per position)."""
        cfg = self.config
        if kv_heads == cfg.num_key_value_heads:
            return self
        check_kv_heads(kv_heads, cfg.num_attention_heads, cfg.num_key_value_heads)
        factor = kv_heads // cfg.num_key_value_heads
        state = {
            name: repeat_kv_rows(value, cfg.head_dim, factor) if name.endswith(("k_proj.weight", "v_proj.weight"))
            else value
            for name, value in self.state_dict().items()
        }
        return self._reshaped(replace(cfg, num_key_value_heads=kv_heads), state)

    def with_layers(self, num_layers: int) -> "DFlashDrafter":
        """This drafter with `num_layers` layers (at least its own) and the same outputs: new layers go last, with
        zero output projections (o_proj, down_proj), so each adds nothing to the residual stream until trained; the
        rest of each new layer starts as a copy of the current last layer: trained projections rather than noise."""
        cfg = self.config
        if num_layers == cfg.num_hidden_layers:
            return self
        if num_layers < cfg.num_hidden_layers:
            raise UserError(f"a drafter of {cfg.num_hidden_layers} layers cannot be cut to {num_layers}: "
                            "--init-from can only add layers")
        state = dict(self.state_dict())
        last = f"layers.{cfg.num_hidden_layers - 1}."
        for i in range(cfg.num_hidden_layers, num_layers):
            for name, value in self.state_dict().items():
                if name.startswith(last):
                    new = f"layers.{i}." + name[len(last):]
                    silent = name.endswith(("o_proj.weight", "down_proj.weight"))
                    state[new] = torch.zeros_like(value) if silent else value.clone()
        return self._reshaped(replace(cfg, num_hidden_layers=num_layers), state)

    def _reshaped(self, cfg: DFlashConfig, state: dict[str, torch.Tensor]) -> "DFlashDrafter":
        """A drafter of shape `cfg` holding `state`, on this one's device and dtype, with its draft vocabulary."""
        weight = self.fc.weight
        other = DFlashDrafter(cfg).to(device=weight.device, dtype=weight.dtype)
        other.load_state_dict(state)
        other.draft_vocab = self.draft_vocab
        return other.train(self.training)

    def freeze(self, plan=None) -> "DFlashDrafter":
        """Fused products for inference (after the last change of weights, device or dtype)."""
        # the target's raw features carry a few huge channels: an int8 plan keeps this product in float
        self.fast_fc = FrozenLinear.of(self.fc, plan.in_float() if plan is not None else None)
        for layer in self.layers:
            layer.self_attn.freeze(plan, context=True)
            layer.mlp.freeze(plan)
        return self.eval()

    def frozen_linears(self) -> list[FrozenLinear]:
        return [m for m in self.modules() if isinstance(m, FrozenLinear)]

    def use_plan(self, plan) -> None:
        """Another plan's kernels for the frozen products (`freeze` first)."""
        for linear in self.frozen_linears():
            linear.use_plan(plan.in_float() if linear is self.fast_fc else plan)

    def new_cache(self, capacity: int = 256) -> KVCache:
        cfg, weight = self.config, self.fc.weight
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, weight.dtype, weight.device,
                       capacity=capacity)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
        mask: torch.Tensor | BlockLayout | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states [batch, block_len, hidden] of the block tokens.

        block_embeds: target embeddings of the block tokens; context_features: raw concatenated target layer outputs
        [batch, ctx_len, n*hidden] (only the NEW ones when a cache is given: they are written at the cache's length,
        and the block right after them). mask: boolean [batch or 1, 1, block_len, ctx_len + block_len], True = may
        attend; a BlockLayout (training: many blocks over one context); None = attend to everything.
        """
        dtype = self.fc.weight.dtype
        fc = self.fast_fc if getattr(self, "fast_fc", None) is not None else self.fc
        # inference (a cache): the norm in one C call where it runs (RMSNorm.rows); training keeps torch's, for grads
        hidden_norm = self.hidden_norm.rows if cache is not None else self.hidden_norm
        ctx = hidden_norm(fc(context_features.to(dtype)))
        rope_ctx = self.rope_of(context_positions, dtype, from_table=cache is not None)
        rope_block = self.rope_of(block_positions, dtype, from_table=cache is not None)
        x = block_embeds.to(dtype)
        if cache is not None:
            cache.reserve(max(cache.lengths) + ctx.shape[1] + x.shape[1])
            out = self._native_forward(x, rope_block, ctx, rope_ctx, block_positions, cache)
            if out is not None:
                cache.advance(ctx.shape[1])
                return self.norm.rows(out)  # one C call (inference: no gradient)
        compiled = isinstance(mask, BlockLayout) and mask.kernel == "compiled" and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, rope_ctx)
            if compiled:
                x = compiled_layer(layer, x, rope_block, ctx_k, ctx_v, mask)
            else:
                x = layer(x, rope_block, ctx_k, ctx_v, mask, cache, i)
        if cache is not None:
            cache.advance(ctx.shape[1])
        return self.norm(x)

    def forward_static(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                       context_features: torch.Tensor, context_positions: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor) -> torch.Tensor:
        """`forward` with a cache, for one sequence, as fixed device ops over fixed buffers (a CUDA graph's call,
        methods/dflash/graphs.py): the new context's keys and values are scattered at `context_positions` [1, W],
        the block's at `block_positions` [1, B], into `keys`/`values` (a KVCache's whole buffers), and the block
        attends to every position before its end, as `forward` attends to the cache up to it. Context padding goes
        past the block's end: never attended, overwritten later. Returns the final hidden states [1, B, hidden];
        the caller moves the cache's length by the real context's count."""
        dtype = self.fc.weight.dtype
        fc = self.fast_fc if getattr(self, "fast_fc", None) is not None else self.fc
        ctx = self.hidden_norm(fc(context_features.to(dtype)))
        rope_ctx, rope_block = self.rotary(context_positions, dtype), self.rotary(block_positions, dtype)
        visible = torch.arange(keys.shape[3], device=keys.device) <= block_positions[:, -1:]  # [1, capacity]
        mask = visible[:, None, None]
        at_context = scatter_index(context_positions, keys.shape[2])
        at_block = scatter_index(block_positions, keys.shape[2])

        x = block_embeds.to(dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            keys[i][at_context], values[i][at_context] = attn.context_kv(ctx, rope_ctx)
            q, k, v = attn.project(layer.input_layernorm(x), rope_block)
            keys[i][at_block], values[i][at_block] = k, v
            x = x + attn.output(attn.attend(q, keys[i], values[i], mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def rope_of(self, positions: torch.Tensor, dtype: torch.dtype, from_table: bool) -> tuple:
        """cos/sin of `positions` [b, n]. A drafting pass's (`from_table`: one sequence, consecutive positions) are
        rows of the rotary's table (the same values): computing them anew took ~10 small ops, 0.17 ms of a ~3 ms
        bfloat16 drafting pass (AMD EPYC Zen 4, 2 threads)."""
        n = positions.shape[1]
        if from_table and positions.shape[0] == 1 and n:
            first = int(positions[0, 0])
            if torch.equal(positions[0], torch.arange(first, first + n, device=positions.device)):
                return self.rotary.spans([first], n, positions, dtype)
        return self.rotary(positions, dtype)

    def _native_forward(self, x: torch.Tensor, rope_block, ctx: torch.Tensor, rope_ctx, block_positions: torch.Tensor,
                        cache: KVCache) -> torch.Tensor | None:
        """Every layer, context keys and values first, in ONE C call (native.drafter_stack) for one sequence, where
        C runs every layer at this many block tokens (the plan chose our kernel for them: a float32 or bfloat16
        drafter on AVX2); else None, and the torch layers run. Between a drafter's ~25 small torch ops a layer, its
        products were a third of its time."""
        keys, values = cache.keys, cache.values
        if (x.shape[0] != 1 or x.shape[1] > MAX_NATIVE_TOKENS or x.device.type != "cpu" or self.training
                or not (keys[0].is_contiguous() and values[0].is_contiguous()) or keys.stride() != values.stride()):
            return None
        constants = [native_constants(layer, layer.self_attn, layer.mlp, layer.input_layernorm,
                                      layer.post_attention_layernorm, x.dtype, x.shape[1]) for layer in self.layers]
        contexts = [layer.self_attn.kv.native_tiles() if layer.self_attn.kv is not None else None
                    for layer in self.layers]
        if any(c is None for c in constants + contexts):
            return None
        cached = self.__dict__.get("_stack_args")
        if cached is None or any(a is not b for a, b in zip(cached[0], constants + contexts)):
            cached = (constants + contexts, native.stack_args(constants, contexts))  # re-made when weights change
            self.__dict__["_stack_args"] = cached
        return native.drafter_stack(x.contiguous(), cached[1], rope_block, int(block_positions[0, 0]),
                                    ctx.contiguous(), rope_ctx, keys, values)

    def forward_rows(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                     contexts: list[torch.Tensor], caches: list[KVCache]) -> torch.Tensor:
        """Inference for several sequences in one pass, each with its own context cache: row r's block
        (block_embeds [b, B, D] at block_positions [b, B]) attends to its cache plus its new context features
        contexts[r] [1, n_r, n*hidden] (written into caches[r] at its length) and to its own block. Returns the final
        hidden states [b, B, D]; each row computes what `forward` with its cache computes alone."""
        dtype = self.fc.weight.dtype
        rows, width = block_positions.shape
        counts = [c.shape[1] for c in contexts]
        ends = [cache.lengths[0] + n for cache, n in zip(caches, counts)]  # where each row's block starts
        for cache, end in zip(caches, ends):
            cache.reserve(end)
        fc = self.fast_fc if getattr(self, "fast_fc", None) is not None else self.fc
        ctx = self.hidden_norm.rows(fc(torch.cat(contexts, dim=1).to(dtype))) if sum(counts) else None
        ctx_positions = torch.cat([torch.arange(cache.lengths[0], end, device=block_positions.device)
                                   for cache, end in zip(caches, ends)])[None]
        rope_ctx = self.rotary(ctx_positions, dtype) if ctx is not None else None
        rope_block = self.rotary(block_positions, dtype)
        key_count = max(ends) + width
        keys_visible = torch.arange(key_count, device=block_positions.device)
        # row r sees its context (< ends[r]) and its block, which goes at ends[r] .. ends[r] + width - 1 below
        mask = (keys_visible < torch.tensor(ends, device=keys_visible.device)[:, None] + width)[:, None, None]
        x = block_embeds.to(dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if ctx is not None:
                ctx_k, ctx_v = attn.context_kv(ctx, rope_ctx)
                for cache, k, v in zip(caches, ctx_k.split(counts, dim=2), ctx_v.split(counts, dim=2)):
                    if k.shape[2]:
                        cache.write(i, k, v)
            q, k, v = attn.project(layer.input_layernorm(x), rope_block)
            keys = k.new_zeros(rows, attn.kv_heads, key_count, attn.head_dim)
            values = torch.zeros_like(keys)
            for r, (cache, end) in enumerate(zip(caches, ends)):
                cached_k, cached_v = cache.read(i, end)
                keys[r, :, :end], values[r, :, :end] = cached_k[0], cached_v[0]
                keys[r, :, end: end + width], values[r, :, end: end + width] = k[r], v[r]
            x = x + attn.output(attn.attend(q, keys, values, mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for cache, n in zip(caches, counts):
            cache.advance(n)
        return self.norm(x)

    # ---- checkpoint ---------------------------------------------------------------------------------------------
    def save(self, folder: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> None:
        write_folder(folder, self.state_dict(), self.config.to_hf_dict(), dtype)
        if self.draft_vocab is not None:
            (Path(folder) / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": self.draft_vocab}) + "\n")

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "DFlashDrafter":
        config, state = read_folder(folder, "drafter")
        drafter = cls(DFlashConfig.from_hf_dict(config))
        load_weights(drafter, state, "drafter", folder)
        drafter.draft_vocab = read_draft_vocab(Path(folder), drafter.config.vocab_size)
        return drafter.to(device=device, dtype=dtype).eval()

    def check_fits(self, target) -> None:
        """Raise a UserError naming the first way this drafter does not fit `target`."""
        from ..base import check_fits

        cfg = self.config
        check_fits("drafter", cfg.hidden_size, cfg.vocab_size, cfg.target_layer_ids, target)
        if not 0 <= cfg.mask_token_id < target.vocab_size:
            raise UserError(f"drafter mask token id {cfg.mask_token_id} is outside the target vocab ({target.vocab_size})")


def read_draft_vocab(folder: Path, vocab_size: int) -> list[int] | None:
    path = folder / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
        ids = sorted({int(i) for i in ids})
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path} is not a draft vocabulary ({{\"token_ids\": [...]}}): {exc}") from exc
    if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
        raise UserError(f"{path}: token ids must lie in [0, {vocab_size})")
    return ids


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """An existing token to use as MASK: the tokenizer's mask token, else an unused special token."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    taken = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    specials = sorted(set(getattr(tokenizer, "all_special_ids", []) or []) - taken)
    specials = [i for i in specials if i < vocab_size]
    return specials[-1] if specials else vocab_size - 1
