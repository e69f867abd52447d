"""The EAGLE-3 draft head (DFLASH_SPEC.md section 8): one decoder layer that drafts a chain autoregressively.

Pairs. Head position j pairs the fused target feature of position j with the token at position j + 1 and predicts
the token at j + 2. The layer's input is [RMSNorm(embed(token)); RMSNorm(hidden)] (width 2D) where hidden =
fc([h_low; h_mid; h_high]) for a real pair. For a speculative pair the head's own output hidden state of the previous
pair stands in for the target feature (the target has not seen the drafted token yet).

Inference keeps K/V of every committed pair in a one-layer KVCache (models/cache.py); speculative pairs are written
past the committed length and overwritten next time: rollback is free.

Checkpoint folder (our own simple format; weight names mirror the public EAGLE-3 Llama heads):
    config.json        {"architectures": ["Eagle3DraftHead"], "model_type": "llama", "num_hidden_layers": 1,
                        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
                        vocab_size (the target's), draft_vocab_size, num_target_layers, target_layer_ids (3 ids,
                        feature of layer i = OUTPUT of decoder layer i), depth, rms_norm_eps, rope_theta,
                        max_position_embeddings}
    model.safetensors  fc.weight [D, 3D]; midlayer.input_layernorm.weight (embedding norm), midlayer.hidden_norm.weight,
                        midlayer.self_attn.{q,k,v}_proj.weight [*, 2D], midlayer.self_attn.o_proj.weight,
                        midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight,
                        norm.weight, lm_head.weight [draft_vocab_size, D],
                        d2t (int64 [draft_vocab_size]: target id of draft index i = i + d2t[i]),
                        t2d (bool [vocab_size]: target id is in the draft vocabulary)
The token embedding is the target's (frozen, not stored).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...checkpoint import load_weights, read_folder, write_folder
from ...errors import UserError
from ...models import native
from ...models.cache import KVCache
from ...models.kernels import FrozenLinear
from ...models.layers import Attention, GatedMLP, RMSNorm, Rotary, causal_mask, native_constants
from ...trees import MAX_TREE_TOKENS, as_int64

IGNORE = -100
DEFAULT_DEPTH = 7


def default_feature_layers(num_target_layers: int) -> list[int]:
    """Low, middle and high target layers as in the reference: [2, L//2, L-3], clamped into [0, L-1] and sorted
    (a 4-layer target gets [1, 2, 2]; a repeated layer is harmless)."""
    last = num_target_layers - 1
    ids = [min(2, last), num_target_layers // 2, max(num_target_layers - 3, 0)]
    return sorted(min(i, last) for i in ids)


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    depth: int = DEFAULT_DEPTH
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def for_target(cls, target_config, vocab_size: int, draft_vocab_size: int | None = None,
                   depth: int = DEFAULT_DEPTH) -> "Eagle3Config":
        """A head as wide as the target, with its heads, MLP width and (full-attention) RoPE base."""
        from ..base import target_shape

        return cls(
            **target_shape(target_config),
            vocab_size=vocab_size,
            draft_vocab_size=min(draft_vocab_size or vocab_size, vocab_size),
            num_target_layers=target_config.num_hidden_layers,
            target_layer_ids=default_feature_layers(target_config.num_hidden_layers),
            depth=depth,
        )

    def to_json_dict(self) -> dict:
        return {"architectures": ["Eagle3DraftHead"], "model_type": "llama", "num_hidden_layers": 1, **asdict(self)}

    @classmethod
    def from_json_dict(cls, d: dict) -> "Eagle3Config":
        if "Eagle3DraftHead" not in d.get("architectures", []):
            raise UserError("config.json is not an EAGLE-3 head config (architectures lacks 'Eagle3DraftHead')")
        fields = cls.__dataclass_fields__
        missing = [f for f, spec in fields.items() if f not in d and spec.default is MISSING]
        if missing:
            raise UserError(f"EAGLE-3 config.json misses {', '.join(missing)}")
        cfg = cls(**{f: d[f] for f in fields if f in d})
        cfg.target_layer_ids = list(cfg.target_layer_ids)
        if len(cfg.target_layer_ids) != 3:
            raise UserError(f"an EAGLE-3 head fuses 3 target layers, config has {cfg.target_layer_ids}")
        return cfg


class Eagle3Layer(nn.Module):
    """The single decoder layer. Its attention reads the 2D-wide [embedding; hidden] input; the residual stream is
    the hidden input (feature or own output), not the embedding."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fused feature / own hidden
        self.self_attn = Attention(2 * cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu")

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual update after attention; `attended` [b, s, H * d]."""
        x = hidden + self.self_attn.output(attended)
        return x + self.mlp(self.post_attention_layernorm(x))


class HiddenHalf(nn.Module):
    """The midlayer's attention cut so that native.c's standard layer runs it. Its q/k/v read
    [norm(embedding) | norm(hidden)], so q/k/v = W_e norm(e) + W_h norm(h): the embedding's half is computed apart
    (`embedding_rows`) and added to each token's q/k/v inside the layer (native.layer's `qkv_rows`), and what is
    left is a pre-norm decoder layer over the hidden state (norm1: the hidden norm; the residual: the hidden state),
    which runs in one call where ~20 small torch ops ran (1.19 ms a bfloat16 draft step after a target step, its
    weights ~0.27 ms of reading). Not a submodule of the head: nothing of it enters the checkpoint."""

    def __init__(self, attn: Attention, plan):
        super().__init__()
        weight = attn.qkv.weight
        half = weight.shape[1] // 2
        # float32, so that the layer rounds q/k/v once, after adding these rows, as the whole product would
        self.embedding_weight = weight[:, :half].float().contiguous()
        self.qkv = FrozenLinear(weight[:, half:].contiguous(), None, plan)
        self.o_fast = attn.o_fast
        self.heads, self.kv_heads, self.head_dim, self.scale = attn.heads, attn.kv_heads, attn.head_dim, attn.scale
        self.q_norm = self.k_norm = None

    def embedding_rows(self, normed: torch.Tensor) -> torch.Tensor:
        """The embedding's half of q/k/v of normed embeddings [1, m, D]: float32 [1, m, q/k/v width]."""
        return F.linear(normed.float(), self.embedding_weight)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary.with_theta(cfg.head_dim, cfg.rope_theta)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(range(cfg.draft_vocab_size))
        self.fast_head: FrozenLinear | None = None
        self.fast_fc: FrozenLinear | None = None

    @classmethod
    def for_target(cls, target, draft_vocab: Iterable[int] | None = None, depth: int = DEFAULT_DEPTH,
                   seed: int = 0) -> "Eagle3Head":
        """A fresh head for `target` with N(0, 0.02) linear weights from a local generator (the global RNG is left
        alone); `draft_vocab` = target ids the head may draft (default: the whole vocabulary)."""
        ids = sorted(set(draft_vocab)) if draft_vocab is not None else None
        cfg = Eagle3Config.for_target(target.config, target.vocab_size, len(ids) if ids else None, depth)
        from ..base import init_untrained

        head = cls(cfg)
        init_untrained(head, seed)
        if ids:
            head.set_draft_vocab(ids)
        return head.to(target.device)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.target_layer_ids)

    def freeze(self, plan=None) -> "Eagle3Head":
        """Fused products for inference (after the last change of weights, device or dtype)."""
        self.midlayer.self_attn.freeze(plan)
        self.midlayer.mlp.freeze(plan)
        # the target's raw features carry a few huge channels: an int8 plan keeps their product in float
        self.fast_fc = FrozenLinear.of(self.fc, plan.in_float() if plan is not None else None)
        self.fast_head = FrozenLinear.of(self.lm_head, plan)
        attn = self.midlayer.self_attn
        self.__dict__["_hidden_half"] = HiddenHalf(attn, plan) if attn.qkv.bias is None and attn.q_norm is None \
            else None
        return self.eval()

    def new_cache(self, capacity: int = 256) -> KVCache:
        cfg, weight = self.config, self.fc.weight
        return KVCache(1, cfg.num_key_value_heads, cfg.head_dim, weight.dtype, weight.device, capacity=capacity)

    # ---- draft vocabulary ------------------------------------------------------------------------------------
    def set_draft_vocab(self, target_ids: Iterable[int]) -> None:
        ids = torch.as_tensor(list(target_ids), dtype=torch.long)
        if ids.numel() != self.config.draft_vocab_size or len(set(ids.tolist())) != ids.numel():
            raise ValueError(f"need {self.config.draft_vocab_size} distinct target ids, got {ids.numel()}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError("draft vocabulary ids must lie inside the target vocabulary")
        ids = ids.sort().values.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, index: torch.Tensor) -> torch.Tensor:
        return index + self.d2t[index]

    def target_ids(self) -> list[int]:
        """draft_to_target of every draft index, as a list kept while d2t stands: a chain's draft reads its target id
        from it instead of two small tensor ops (~0.08 ms a draft after a target step)."""
        d2t = self.d2t
        key = (d2t.data_ptr(), None if d2t.is_inference() else d2t._version)
        kept = self.__dict__.get("_target_ids")
        if kept is None or kept[0] != key:
            ids = self.draft_to_target(torch.arange(d2t.numel(), device=d2t.device)).tolist()
            kept = self.__dict__["_target_ids"] = (key, ids)
        return kept[1]

    def target_to_draft(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Draft index of each target id, IGNORE where the draft vocabulary lacks it."""
        lookup = torch.full((self.config.vocab_size,), IGNORE, dtype=torch.long, device=self.d2t.device)
        draft_ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        lookup[self.draft_to_target(draft_ids)] = draft_ids
        return lookup[token_ids]

    # ---- running -----------------------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Raw concatenated target layer outputs [b, s, 3D] -> the hidden input of a real pair [b, s, D]."""
        features = features.to(self.fc.weight.dtype)
        return self.fast_fc(features) if self.fast_fc is not None else self.fc(features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the DRAFT vocabulary."""
        # drafting (no gradient): the norm in one C call where it runs (RMSNorm.rows); training: torch's
        normed = self.norm(hidden) if self.training or torch.is_grad_enabled() else self.norm.rows(hidden)
        return self.fast_head(normed) if self.fast_head is not None else self.lm_head(normed)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, at: int, cache: KVCache) -> torch.Tensor:
        """Inference: pairs at positions at..at+m-1; their K/V are written to `cache` at those positions (the caller
        decides whether the cache's length moves past them). Returns the output hidden states."""
        m = embeds.shape[1]
        out = self._native_step(embeds, hidden, at, cache)
        if out is not None:
            return out
        positions = torch.arange(at, at + m, device=embeds.device)[None]
        attn = self.midlayer.self_attn
        x = self.midlayer.attention_input(embeds.to(hidden.dtype), hidden)
        q, k, v = attn.project(x, self.rotary(positions, hidden.dtype))
        cache.reserve(at + m)
        keys, values = cache.write(0, k, v, offset=at - cache.lengths[0])
        mask = causal_mask(positions, at + m) if m > 1 else None  # causal among the new pairs
        return self.midlayer.finish(hidden, attn.attend(q, keys, values, mask))

    def _native_step(self, embeds: torch.Tensor, hidden: torch.Tensor, at: int, cache: KVCache,
                     tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """`step` in one C call (HiddenHalf), or None where it cannot run there (not frozen, another device, a
        batch, the plan's kernels not ours at this many rows, a bias or q/k norms). `tree` = (positions, visible):
        a tree's depth instead (`tree_step`), the pairs at cache slots at.. and RoPE positions `positions`, each
        seeing what `visible` marks; the tree's region of the cache (from the committed length on: the earlier
        depths' nodes, then these) goes to C as a 64-bit word a node (native.c's tree_back), so None also where
        that region passes 64 slots."""
        half = self.__dict__.get("_hidden_half")
        if half is None or self.training or hidden.device.type != "cpu" or hidden.shape[0] != 1:
            return None
        mid, m, committed = self.midlayer, embeds.shape[1], cache.lengths[0]
        if tree is not None and (at + m - committed > MAX_TREE_TOKENS or not bool(tree[1][:, :committed].all())):
            return None
        constants = native_constants(half, half, mid.mlp, mid.hidden_norm, mid.post_attention_layernorm,
                                     hidden.dtype, m)
        if constants is None:
            return None
        cache.reserve(at + m)
        keys, values = cache.keys[0], cache.values[0]
        if not keys.is_contiguous():
            return None
        rows = half.embedding_rows(mid.input_layernorm.rows(embeds.to(hidden.dtype)))
        if tree is None:
            rope = self.rotary.spans([at], m, None, hidden.dtype, device=hidden.device)
            return native.layer(hidden.contiguous(), constants, rope, keys, values, torch.tensor([at]), rows)
        positions, visible = tree
        rope = self.rotary.spans([at], m, positions[None], hidden.dtype, in_order=False)
        bits = [sum(1 << j for j, seen in enumerate(row) if seen) for row in visible[:, committed:].tolist()]
        return native.layer(hidden.contiguous(), constants, rope, keys, values, torch.tensor([at]), rows,
                            tree=as_int64([bits]), tree_back=at - committed)

    def tree_step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slot: int,
                  visible: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Inference, a draft tree's next depth: m speculative pairs [1, m] (each node's token with its parent's
        hidden state) at `positions` [m] (their depth's), their K/V written to cache slots slot..slot+m-1 past the
        committed length; `visible` [m, slot + m] says which keys each attends to (the committed ones, its
        ancestors' slots and its own). Returns their output hidden states."""
        m = embeds.shape[1]
        out = self._native_step(embeds, hidden, slot, cache, tree=(positions, visible))
        if out is not None:
            return out
        attn = self.midlayer.self_attn
        x = self.midlayer.attention_input(embeds.to(hidden.dtype), hidden)
        q, k, v = attn.project(x, self.rotary(positions[None], hidden.dtype))
        cache.reserve(slot + m)
        keys, values = cache.write(0, k, v, offset=slot - cache.lengths[0])
        return self.midlayer.finish(hidden, attn.attend(q, keys, values, visible[None, None]))

    # ---- checkpoint ------------------------------------------------------------------------------------------
    def save(self, folder: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write config.json + model.safetensors; float weights cast to `dtype` when given (d2t/t2d never are)."""
        write_folder(folder, self.state_dict(), self.config.to_json_dict(), dtype)

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "Eagle3Head":
        config, state = read_folder(folder, "EAGLE-3 head")
        head = cls(Eagle3Config.from_json_dict(config))
        load_weights(head, state, "EAGLE-3 head", folder)
        head.to(device)
        return head.to(dtype=dtype).eval()  # casts float tensors only; d2t/t2d keep their types

    def check_fits(self, target) -> None:
        from ..base import check_fits

        cfg = self.config
        check_fits("EAGLE-3 head", cfg.hidden_size, cfg.vocab_size, cfg.target_layer_ids, target)
