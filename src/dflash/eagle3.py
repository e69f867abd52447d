"""The EAGLE-3 baseline (DFLASH_SPEC.md section 8): a one-layer draft head that drafts a chain autoregressively.

Pairs. Head position j pairs the fused target feature of position j with the token at position j + 1 and predicts
the token at j + 2. The layer's input is [RMSNorm(embed(token)); RMSNorm(hidden)] (width 2D) where hidden =
fc([h_low; h_mid; h_high]) for a real pair. For a speculative pair the head's own output hidden state of the previous
pair stands in for the target feature (the target has not seen the drafted token yet).

Inference (chain, top-1). The head keeps K/V of every committed pair in a preallocated buffer written by position.
Each `propose` first adds the pairs whose feature arrived since the last call (the newest one pairs the last committed
feature with the pending bonus token), then runs `depth` - 1 speculative steps whose K/V land past the committed
length and are simply overwritten next time: rollback is free.

Training-time test (TTT). `unroll` reproduces inference for EVERY position at once: step k at position j uses the
hidden state step k-1 produced at j-1 and attends to step-0 keys at positions <= j-k (the chain's real root and
before) plus step-i keys at j-k+i for i = 1..k (its own chain), exactly what the speculative step sees at inference.

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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .drafter import MLP, RMSNorm, Rotary, apply_rotary
from .checkpoint import load_weights, read_folder, write_folder
from .errors import UserError
from .packed import pack_linears
from .proposers import Proposer

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
        """A head as wide as the target, with its heads, MLP width and RoPE base."""
        heads = target_config.num_attention_heads
        rope = getattr(target_config, "rope_parameters", None) or {}
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            vocab_size=vocab_size,
            draft_vocab_size=min(draft_vocab_size or vocab_size, vocab_size),
            num_target_layers=target_config.num_hidden_layers,
            target_layer_ids=default_feature_layers(target_config.num_hidden_layers),
            depth=depth,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            max_position_embeddings=getattr(target_config, "max_position_embeddings", 8192),
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


# ---- the head ---------------------------------------------------------------------------------------------------
class Eagle3Attention(nn.Module):
    """Llama attention (RoPE, GQA) whose q/k/v projections read the 2D-wide [embedding; hidden] input."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, heads, self.head_dim).transpose(1, 2)

    def project(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, H, s, hd], k and v [b, KV, s, hd]; RoPE applied to q and k."""
        q = apply_rotary(self._split(self.q_proj(x), self.heads), rope)
        k = apply_rotary(self._split(self.k_proj(x), self.kv_heads), rope)
        return q, k, self._split(self.v_proj(x), self.kv_heads)

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class Eagle3Layer(nn.Module):
    """The single decoder layer. The residual stream is the hidden input (feature or own output), not the embedding."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fused feature / own hidden
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = hidden + self.self_attn.merge(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Cache:
    """K/V of the head's pairs, preallocated and written by position; `length` counts committed pairs."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [1, KV, m, hd] at positions at..at+m-1; return all K/V up to at+m."""
        end = at + k.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(k, max(2 * end, 256))
        self.keys[:, :, at:end] = k
        self.values[:, :, at:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, like: torch.Tensor, capacity: int) -> None:
        b, kv, _, hd = like.shape
        keys, values = like.new_zeros(b, kv, capacity, hd), like.new_zeros(b, kv, capacity, hd)
        if self.keys is not None:
            keys[:, :, : self.keys.shape[2]] = self.keys
            values[:, :, : self.values.shape[2]] = self.values
        self.keys, self.values = keys, values


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(range(cfg.draft_vocab_size))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    @classmethod
    def for_target(cls, target, draft_vocab: Iterable[int] | None = None, depth: int = DEFAULT_DEPTH) -> "Eagle3Head":
        """A fresh head for `target`; `draft_vocab` = target ids the head may draft (default: the whole vocabulary)."""
        ids = sorted(set(draft_vocab)) if draft_vocab is not None else None
        cfg = Eagle3Config.for_target(target.config, target.vocab_size, len(ids) if ids else None, depth)
        head = cls(cfg)
        if ids:
            head.set_draft_vocab(ids)
        return head.to(target.device)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.target_layer_ids)

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

    def target_to_draft(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Draft index of each target id, IGNORE where the draft vocabulary lacks it."""
        lookup = torch.full((self.config.vocab_size,), IGNORE, dtype=torch.long, device=self.d2t.device)
        draft_ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        lookup[self.draft_to_target(draft_ids)] = draft_ids
        return lookup[token_ids]

    # ---- running -----------------------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Raw concatenated target layer outputs [b, s, 3D] -> the hidden input of a real pair [b, s, D]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the DRAFT vocabulary."""
        return self.lm_head(self.norm(hidden))

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, at: int, cache: Eagle3Cache) -> torch.Tensor:
        """Inference: pairs at positions at..at+m-1 after the cached ones; their K/V are written to `cache` at those
        positions (the caller decides whether `cache.length` moves past them). Returns the output hidden states."""
        m = embeds.shape[1]
        positions = torch.arange(at, at + m, device=embeds.device)[None]
        attn = self.midlayer.self_attn
        q, k, v = attn.project(self.midlayer.attention_input(embeds.to(hidden.dtype), hidden), self.rotary(positions))
        keys, values = cache.write(at, k, v)
        mask = None
        if m > 1:  # causal among the new pairs; all cached pairs are earlier
            mask = torch.arange(at + m, device=embeds.device)[None] <= positions[0][:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=attn.heads != attn.kv_heads)
        return self.midlayer.finish(hidden, out)

    def unroll(self, embeds: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over all positions: the output hidden states [b, s, D] of steps 0..steps-1.
        embeds: target embeddings of the pairs' tokens; hidden: fused target features of the pairs."""
        positions = torch.arange(embeds.shape[1], device=embeds.device)[None]
        rope = self.rotary(positions)
        attn = self.midlayer.self_attn
        embeds = embeds.to(hidden.dtype)
        keys, values, outputs = [], [], []
        for k in range(steps):
            if k > 0:  # position j continues the chain of position j-1: its hidden is the previous step's output there
                hidden = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))
            q, key, value = attn.project(self.midlayer.attention_input(embeds, hidden), rope)
            keys.append(key)
            values.append(value)
            outputs.append(self.midlayer.finish(hidden, ttt_attention(q, keys, values)))
        return outputs

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
        cfg = self.config
        if cfg.hidden_size != target.hidden_size:
            raise UserError(f"EAGLE-3 head hidden size {cfg.hidden_size} != target hidden size {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            raise UserError(f"EAGLE-3 head vocab size {cfg.vocab_size} != target vocab size {target.vocab_size}")
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise UserError(f"EAGLE-3 feature layers {bad} are out of range for a {target.num_layers}-layer target")


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of step k = len(keys) - 1 at every position j: step-0 keys at positions <= j-k, and step-i keys at
    position j-k+i for i = 1..k (the diagonal of the speculative chain). Positions j < k have no real root; they only
    see what exists (at least their own key) and carry no loss."""
    k = len(keys) - 1
    heads, seq = q.shape[1], q.shape[2]
    scale = q.shape[-1] ** -0.5

    def expand(t: torch.Tensor) -> torch.Tensor:  # GQA: kv head g serves query heads g*r .. g*r+r-1 (as SDPA does)
        return t.repeat_interleave(heads // t.shape[1], dim=1)

    def shift(t: torch.Tensor, by: int) -> torch.Tensor:  # t'[j] = t[j - by]
        return F.pad(t[:, :, : seq - by], (0, 0, by, 0)) if by else t

    rows = torch.arange(seq, device=q.device)
    scores = [(q @ expand(keys[0]).transpose(-1, -2)) * scale]
    scores[0] = scores[0].masked_fill(rows[None, :] > rows[:, None] - k, float("-inf"))
    shifted_values = []
    for i in range(1, k + 1):
        key = shift(expand(keys[i]), k - i)
        diagonal = (q * key).sum(-1, keepdim=True) * scale
        scores.append(diagonal.masked_fill((rows < k - i)[:, None], float("-inf")))
        shifted_values.append(shift(expand(values[i]), k - i))
    weights = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
    out = weights[..., :seq] @ expand(values[0])
    for i, value in enumerate(shifted_values):
        out = out + weights[..., seq + i : seq + i + 1] * value
    return out


# ---- draft vocabulary from data ------------------------------------------------------------------------------------
def frequent_tokens(sequences: Iterable[Iterable[int]], vocab_size: int, size: int) -> list[int]:
    """The `size` most frequent target ids in `sequences` (ties: lower id first), topped up with the lowest unseen ids
    so the head always has exactly min(size, vocab_size) entries. Ids outside [0, vocab_size) are not counted.
    Counts with numpy in chunks: a training set has hundreds of millions of tokens."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk: list[np.ndarray] = []
    pending = 0

    def flush() -> None:
        ids = np.concatenate(chunk)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts[:] += np.bincount(ids, minlength=vocab_size)
        chunk.clear()

    for seq in sequences:
        if isinstance(seq, torch.Tensor):
            seq = seq.cpu().numpy()
        elif not isinstance(seq, (list, tuple, np.ndarray)):
            seq = list(seq)
        ids = np.asarray(seq, dtype=np.int64).reshape(-1)
        chunk.append(ids)
        pending += ids.size
        if pending >= 1 << 24:
            flush()
            pending = 0
    if chunk:
        flush()
    ranked = np.lexsort((np.arange(vocab_size), -counts))[: min(size, vocab_size)]  # count desc, then id asc
    return sorted(int(t) for t in ranked)


# ---- training loss ---------------------------------------------------------------------------------------------
def _label_mask(input_ids: torch.Tensor, loss_start) -> torch.Tensor:
    """Bool [b, s]: positions whose token is a training label. `loss_start` is an int, a [b] tensor of first
    response indices, or already a bool [b, s] mask (e.g. response and not padding)."""
    if isinstance(loss_start, torch.Tensor) and loss_start.dtype == torch.bool:
        return loss_start.to(input_ids.device)
    start = torch.as_tensor(loss_start, device=input_ids.device).reshape(-1, 1)
    return torch.arange(input_ids.shape[1], device=input_ids.device)[None] >= start


def eagle3_loss(head: Eagle3Head, target, input_ids: torch.Tensor, loss_start, features: torch.Tensor | None = None,
                steps: int = DEFAULT_DEPTH, decay: float = 0.8) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Training-time-test loss over sequences `input_ids` [b, s] (prompt + target-regenerated response).

    Pair j = (feature j, token j+1) predicts token j+2, whose value in the data is the target's own choice. Step k
    unrolls the head on its own outputs; its cross-entropy over the draft vocabulary is weighted decay**k and the sum
    is divided by the sum of the weights of the steps that have labels. Labels outside the draft vocabulary and
    positions before `loss_start` are ignored. `features` [b, s, 3D]: the target's outputs of head.feature_layers
    (computed here when None). Metrics (detached, on the device): loss, accuracy [steps] (top-1 per step) and tau
    (1 + mean number of leading correct steps over chains with all steps labelled; a surrogate of acceptance).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.shape[1] < 3:
        raise ValueError("eagle3_loss needs sequences of at least 3 tokens")
    if features is None:
        features = target.forward(input_ids, None, head.feature_layers).features
    if features.is_inference():  # autograd may not save inference tensors (target.forward runs in inference mode)
        features = features.clone()
    with torch.no_grad():
        embeds = target.embed_tokens(input_ids[:, 1:-1])
    labels = head.target_to_draft(input_ids[:, 2:])
    labels = labels.masked_fill(~_label_mask(input_ids, loss_start)[:, 2:], IGNORE)
    outputs = head.unroll(embeds, head.fuse(features[:, :-2]), steps)

    total = weight_sum = torch.zeros((), device=input_ids.device)
    accuracy, correct_steps = [], []
    for k, hidden in enumerate(outputs):
        step_labels = labels.clone()
        step_labels[:, :k] = IGNORE  # no real root k pairs back
        valid = step_labels != IGNORE
        logits = head.logits(hidden[valid])
        if logits.shape[0]:
            total = total + decay**k * F.cross_entropy(logits.float(), step_labels[valid])
            weight_sum = weight_sum + decay**k
        correct = torch.zeros_like(valid)
        correct[valid] = logits.argmax(-1) == step_labels[valid]
        accuracy.append(correct.sum() / valid.sum().clamp_min(1))
        correct_steps.append(correct)
    loss = total / weight_sum.clamp_min(1e-12)
    return loss, {"loss": loss.detach(), "accuracy": torch.stack(accuracy).detach(),
                  "tau": _surrogate_tau(correct_steps, labels, steps)}


def _surrogate_tau(correct_steps: list[torch.Tensor], labels: torch.Tensor, steps: int) -> torch.Tensor:
    """1 + leading correct drafts of the chain rooted at each pair r (its step-k draft sits at pair r+k)."""
    n = labels.shape[1] - steps + 1
    if n <= 0:
        return torch.ones((), device=labels.device)
    chain_ok = torch.stack([c[:, k : k + n] for k, c in enumerate(correct_steps)], dim=-1)  # [b, n, steps]
    has_all = torch.stack([labels[:, k : k + n] != IGNORE for k in range(steps)], dim=-1).all(-1)
    lengths = 1 + chain_ok.long().cumprod(-1).sum(-1).float()
    return (lengths[has_all].mean() if has_all.any() else torch.ones((), device=labels.device)).detach()


class Eagle3Objective:
    """The EAGLE-3 head behind the trainer's objective interface (`loss(example, rng) -> (loss, metrics)`), the same
    interface as blocks.DFlashObjective: one clean target pass for features, one unrolled head pass."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, target, steps: int = DEFAULT_DEPTH, decay: float = 0.8,
                 max_length: int = 3072):
        head.check_fits(target)
        self.model, self.target = head, target
        self.steps, self.decay = steps, decay
        self.max_length = min(max_length, target.max_context)

    def sequence(self, input_ids) -> torch.Tensor:
        return torch.as_tensor(input_ids)[: self.max_length].to(self.target.device, torch.long)

    def usable(self, example) -> bool:
        """False when the (truncated) sequence has no response token that a pair predicts (pairs predict j + 2)."""
        return min(len(example.input_ids), self.max_length) > max(example.loss_start, 2)

    def loss(self, example, rng: np.random.Generator | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        input_ids = self.sequence(example.input_ids)
        return eagle3_loss(self.model, self.target, input_ids, example.loss_start, None, self.steps, self.decay)

    @torch.no_grad()
    def evaluate(self, examples, rngs=None) -> dict:
        losses, taus, accuracies = [], [], []
        for example in examples:
            loss, metrics = self.loss(example)
            losses.append(float(loss))
            taus.append(float(metrics["tau"]))
            accuracies.append(metrics["accuracy"])
        if not losses:
            return {}
        return {"eval_loss": float(np.mean(losses)), "eval_tau": float(np.mean(taus)),
                "eval_accuracy": torch.stack(accuracies).mean(0).tolist()}

    def save(self, folder, dtype: torch.dtype | None = None) -> None:
        self.model.save(folder, dtype=dtype)


# ---- inference ------------------------------------------------------------------------------------------------------
class Eagle3Proposer(Proposer):
    """Chain drafting (top-1) with the head: `depth` drafts per round, verified by the shared engine."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, target, depth: int | None = None):
        head.check_fits(target)
        self.depth = depth or head.config.depth
        if self.depth < 1:
            raise UserError(f"EAGLE-3 draft depth must be >= 1, got {self.depth}")
        self.head, self.target = head.eval(), target
        self.feature_layers = head.feature_layers
        self.max_draft = self.depth

    def start(self, prompt_ids: list[int], features: torch.Tensor | None) -> None:
        self.cache = Eagle3Cache()
        self.pending = features

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None:
        self.pending = features if self.pending is None else torch.cat([self.pending, features], dim=1)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(token_ids)

    @torch.inference_mode()
    def propose(self, sequence: list[int]) -> list[int]:
        last = len(sequence) - 1  # position of the pending bonus token
        done = self.cache.length
        assert self.pending is not None and done + self.pending.shape[1] == last, "head out of step with the target"
        device = self.target.device
        # new real pairs: committed features done..last-1 with the tokens that follow them (the last one: the bonus)
        tokens = torch.tensor([sequence[done + 1 : last + 1]], device=device)
        hidden = self.head.step(self._embed(tokens), self.head.fuse(self.pending), done, self.cache)[:, -1:]
        self.cache.length, self.pending = last, None
        drafts = []
        for k in range(self.depth):
            logits = self.head.logits(hidden).float()  # float32: a bf16 argmax is several times slower on CPU
            token = self.head.draft_to_target(logits.argmax(-1))  # [1, 1], stays on the device
            drafts.append(token)
            if k + 1 < self.depth:  # speculative pair at position last+k: written past the committed length
                hidden = self.head.step(self._embed(token), hidden, last + k, self.cache)
        return torch.cat(drafts, dim=1)[0].tolist()


def build_eagle3_proposer(target, path: str | Path | None = None, depth: int | None = None,
                          dtype: torch.dtype | None = None) -> tuple[Eagle3Proposer, str | None]:
    """The head at `path`, else the shipped one for this target, else an UNTRAINED head (with a note saying so)."""
    from .loading import SHIPPED_DRAFTERS

    note = None
    if path is None:
        shipped = SHIPPED_DRAFTERS / f"{target.name}-eagle3"
        if (shipped / "config.json").is_file():
            path = shipped
    elif not Path(path).exists():
        raise UserError(f"EAGLE-3 head folder not found: {path}")
    if path is None:
        note = f"no trained EAGLE-3 head ships for {target.name}: using an UNTRAINED head (expect tau ~1, no speedup)"
        with torch.random.fork_rng(devices=[]):  # deterministic, without disturbing the caller's RNG
            torch.manual_seed(0)
            head = Eagle3Head.for_target(target)
    else:
        head = Eagle3Head.load(path, device=str(target.device))
    # run in the target's dtype (or the chosen draft dtype), like the DFlash drafter, so both pay alike
    head = head.to(device=target.device, dtype=dtype or target.dtype)
    pack_linears(head)  # loaded for drafting only: its weights no longer change
    return Eagle3Proposer(head, target, depth), note
