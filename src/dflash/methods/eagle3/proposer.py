"""EAGLE-3 drafting: a chain (top-1) of up to `depth` drafts per round from the one-layer head."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import UserError
from ..base import Draft, DraftPrecision, FeatureBacklog, MethodOptions, Proposer, in_draft_dtype, shipped_drafter
from .head import Eagle3Head


class Eagle3Proposer(FeatureBacklog, Proposer):
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
        self.cache = self.head.new_cache(capacity=len(prompt_ids) + 256)
        self.pending = [features]

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None:
        self.pending.append(features)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(token_ids)

    @torch.inference_mode()
    def propose(self, sequence: list[int], limit: int | None = None, keep_going=None) -> Draft:
        last = len(sequence) - 1  # position of the pending bonus token
        done = self.cache.lengths[0]
        pending = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending, dim=1)
        if done + pending.shape[1] != last:
            raise RuntimeError("EAGLE-3 head out of step with the target")
        device = self.target.device
        # new real pairs: committed features done..last-1 with the tokens that follow them (the last one: the bonus)
        tokens = torch.tensor([sequence[done + 1: last + 1]], device=device)
        hidden = self.head.step(self._embed(tokens), self.head.fuse(pending), done, self.cache)[:, -1:]
        self.cache.advance(last - done)  # the real pairs are committed; speculative ones are not
        self.pending = []
        depth = self.depth if limit is None else min(limit, self.depth)
        drafts, confidences = [], []
        for k in range(depth):
            logits = self.head.logits(hidden).float()  # float32: a bf16 argmax is several times slower on CPU
            confidence, index = logits.softmax(-1).max(-1)
            drafts.append(int(self.head.draft_to_target(index)))
            confidences.append(float(confidence))
            if k + 1 == depth or (keep_going is not None and not keep_going(confidences)):
                break
            # the next speculative pair, at position last+k: written past the committed length
            token = torch.tensor([[drafts[-1]]], device=device)
            hidden = self.head.step(self._embed(token), hidden, last + k, self.cache)
        return Draft(drafts, confidences)


def build(target, options: MethodOptions) -> tuple[Eagle3Proposer, str | None]:
    """The head at `options.drafter`, else the shipped one for this target, else an UNTRAINED head (with a note);
    `options.block_size` B drafts chains of B - 1."""
    return in_draft_dtype("eagle3", target, options, lambda precision: load(target, options, precision))


def load(target, options: MethodOptions, precision: DraftPrecision) -> tuple[Eagle3Proposer, str | None]:
    path, note = options.drafter, None
    if path is None:
        path = shipped_drafter(target.name, "eagle3")
    elif not Path(path).exists():
        raise UserError(f"EAGLE-3 head folder not found: {path}")
    if path is None:
        note = f"no trained EAGLE-3 head ships for {target.name}: using an UNTRAINED head (expect tau ~1, no speedup)"
        head = Eagle3Head.for_target(target)
    else:
        head = Eagle3Head.load(path, device=str(target.device))
    # run in the target's dtype (or the chosen draft dtype), like the DFlash drafter, so both pay alike
    head = head.to(device=target.device, dtype=precision.dtype).freeze(precision.plan_for(target))
    depth = options.block_size - 1 if options.block_size else None
    return Eagle3Proposer(head, target, depth), note
