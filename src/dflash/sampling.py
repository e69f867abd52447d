"""Choosing the target's token at each position, and deciding how many draft tokens it accepts.

Acceptance rule (DFLASH_SPEC.md section 3): the target picks its own token at every block position (argmax at T=0,
a sample from its processed distribution at T>0); draft token k is accepted iff it equals the target's pick at the
position before it, up to the first mismatch. With deterministic (one-hot) drafts this is exactly speculative
rejection sampling, so the output has the target's distribution. Top-k / top-p are applied to the target's
distribution the same way in every method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution the target samples from: temperature, then top-k, then top-p (HF's order)."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass; the first always stays
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def pick_tokens(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The target's choice at each position of `logits` [seq, vocab] -> [seq]."""
    if cfg.greedy:
        return logits.argmax(-1)
    probs = target_probs(logits, cfg)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accept_length(draft_tokens: list[int], target_tokens: list[int]) -> int:
    """Number of leading draft tokens equal to the target's choice at the preceding position."""
    accepted = 0
    for drafted, chosen in zip(draft_tokens, target_tokens):
        if drafted != chosen:
            break
        accepted += 1
    return accepted
