"""Proposers: whatever suggests draft tokens for the ONE verification loop in `engine.py`.

A proposer sees the committed sequence (prompt + output; its last token is the pending "bonus", not yet in the
target's KV cache) and returns up to `max_draft` tokens that should follow it. After each verify round the engine
calls `commit` with the tokens that entered the target's cache and their target features, so feature-reading
proposers (DFlash, EAGLE-3) can extend their context.
"""

from __future__ import annotations

import torch

from .drafter import DFlashDrafter, DrafterCache
from .errors import UserError
from .packed import FrozenLinear


class Proposer:
    """No drafts: plain autoregressive decoding through the same engine (the `ar` baseline)."""

    name = "ar"
    feature_layers: tuple[int, ...] = ()
    max_draft = 0

    def start(self, prompt_ids: list[int], features: torch.Tensor | None) -> None:
        """Called once after the target's prefill with the prompt's target features."""

    def propose(self, sequence: list[int]) -> list[int]:
        return []

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None:
        """`token_ids` entered the target's cache (the old bonus and the accepted drafts)."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the sequence's tail and copy what followed it."""

    name = "ngram"

    def __init__(self, max_draft: int = 7, max_ngram: int = 3, min_ngram: int = 1):
        self.max_draft, self.max_ngram, self.min_ngram = max_draft, max_ngram, min_ngram

    def propose(self, sequence: list[int]) -> list[int]:
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            tail = sequence[-n:]
            # latest match first: recent text predicts the continuation best
            for start in range(len(sequence) - n - 1, -1, -1):
                if sequence[start : start + n] == tail:
                    follow = sequence[start + n : start + n + self.max_draft]
                    if follow:
                        return follow
        return []


class DFlashProposer(Proposer):
    """Block diffusion drafting: one drafter pass proposes block_size - 1 tokens."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, target, block_size: int | None = None, min_confidence: float = 0.0):
        trained = drafter.config.block_size
        self.block_size = block_size or trained
        if not 2 <= self.block_size <= trained:
            raise UserError(f"block size must be in [2, {trained}] for this drafter (trained with {trained})")
        if not 0.0 <= min_confidence <= 1.0:
            raise UserError(f"min confidence must be in [0, 1], got {min_confidence}")
        self.min_confidence = min_confidence
        drafter.check_fits(target)
        self.drafter, self.target = drafter, target
        self.feature_layers = tuple(drafter.config.target_layer_ids)
        self.max_draft = self.block_size - 1
        self.mask_token_id = drafter.config.mask_token_id
        self._param = next(drafter.parameters())
        # Drafts never change the output, only how many are accepted, so the drafter may run in a cheaper dtype
        # than the target (bf16 beside a float32 target on CPU); it then needs its own copy of the LM head.
        head = target.lm_head.weight
        if head.dtype == self._param.dtype:
            self.lm_head = target.lm_head  # packed already when the target was loaded for inference
        else:
            self.lm_head = FrozenLinear(head.detach().to(self._param.dtype))

    def start(self, prompt_ids: list[int], features: torch.Tensor | None) -> None:
        self.cache = DrafterCache(len(self.drafter.layers))
        self.pending = features

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None:
        self.pending = features if self.pending is None else torch.cat([self.pending, features], dim=1)

    @torch.inference_mode()
    def propose(self, sequence: list[int]) -> list[int]:
        start = len(sequence) - 1  # position of the bonus token
        device = self._param.device
        block = torch.tensor([[sequence[-1]] + [self.mask_token_id] * self.max_draft], device=device)
        ctx_len = self.pending.shape[1]
        ctx_positions = torch.arange(self.cache.length, self.cache.length + ctx_len, device=device)[None]
        assert self.cache.length + ctx_len == start, "drafter context out of step with the target"
        hidden = self.drafter(
            self.target.embed_tokens(block),
            torch.arange(start, start + self.block_size, device=device)[None],
            self.pending,
            ctx_positions,
            cache=self.cache,
        )
        self.pending = None
        # 2-D on purpose: with the drafter's 3-D bf16 output an unpacked head took 44 ms instead of 3 ms on our CPU.
        # float32: argmax over bf16 logits took 2.5 ms for 15 rows, converting first 0.5 ms (same indices)
        logits = self.lm_head(hidden[0, 1:]).float()
        return confident_drafts(logits, self.min_confidence).tolist()


def confident_drafts(logits: torch.Tensor, min_confidence: float) -> torch.Tensor:
    """The argmax drafts of float32 `logits` [k, vocab], cut before the first draft j at which the drafter's own
    belief that drafts 1..j are all right (the product of its top probabilities) falls below `min_confidence`.
    A draft after a wrong one is never accepted, and on a CPU every verified token costs time."""
    if min_confidence <= 0:
        return logits.argmax(-1)
    top_probability, drafts = logits.softmax(-1).max(-1)  # softmax keeps the order: the same drafts as argmax
    return drafts[: int((top_probability.cumprod(0) >= min_confidence).sum())]
