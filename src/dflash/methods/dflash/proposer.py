"""DFlash drafting: one drafter pass proposes block_size - 1 tokens, with the drafter's confidence in each."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import UserError
from ...models.kernels import FrozenLinear
from ..base import Draft, DraftPrecision, FeatureBacklog, MethodOptions, Proposer, in_draft_dtype, shipped_drafter
from .drafter import DFlashConfig, DFlashDrafter, default_mask_token_id


class DFlashProposer(FeatureBacklog, Proposer):
    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, target, block_size: int | None = None, plan=None):
        trained = drafter.config.block_size
        self.block_size = block_size or trained
        if not 2 <= self.block_size <= trained:
            raise UserError(f"block size must be in [2, {trained}] for this drafter (trained with {trained})")
        drafter.check_fits(target)
        self.drafter, self.target = drafter, target
        self.plan = plan or target.kernel_plan  # the drafter's kernels: int8 ones, or the target's
        self.feature_layers = tuple(drafter.config.target_layer_ids)
        self.max_draft = self.block_size - 1
        self.mask_token_id = drafter.config.mask_token_id
        # Drafts never change the output, only how many are accepted, so the drafter may run in a cheaper dtype
        # than the target, and may score only some rows of the frozen LM head: its draft vocabulary, plus the
        # tokens of the prompt at hand (a drafter copies names and identifiers from it, however rare they are).
        # The base head (the draft vocabulary's rows, or all) is laid out for its kernel once, at load; the prompt's
        # other tokens form a small second head, made per prompt: re-making the whole head per prompt cost 35 ms,
        # and packing it (oneDNN or int8) another 20-80 ms at the first draft.
        head = target.lm_head.weight.detach()
        self.full_head = head if head.dtype == drafter.fc.weight.dtype else head.to(drafter.fc.weight.dtype)
        self.base_vocab = drafter.draft_vocab
        self.base_set = None if self.base_vocab is None else frozenset(self.base_vocab)
        self.base_ids = None if self.base_vocab is None else torch.tensor(sorted(self.base_vocab),
                                                                          device=head.device)
        rows = self.full_head if self.base_ids is None else self.full_head[self.base_ids]
        self.lm_head = FrozenLinear(rows, plan=self.plan)
        self.vocab_ids = self.base_ids  # what the heads' columns are, in order (None: the whole vocabulary)
        self.prompt_rows: torch.Tensor | None = None

    def start(self, prompt_ids: list[int], features: torch.Tensor | None) -> None:
        self.cache = self.drafter.new_cache(capacity=len(prompt_ids) + 256)
        self.pending = [features]
        if self.base_vocab is not None:  # a drafter copies names and numbers from its prompt, however rare
            extra = torch.tensor(sorted(set(prompt_ids) - self.base_set), dtype=torch.long,
                                 device=self.base_ids.device)
            self.prompt_rows = self.full_head[extra] if len(extra) else None
            self.vocab_ids = torch.cat([self.base_ids, extra])

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None:
        self.pending.append(features)

    @torch.inference_mode()
    def propose(self, sequence: list[int], limit: int | None = None, keep_going=None) -> Draft:
        start = len(sequence) - 1  # position of the bonus token
        device = self.drafter.fc.weight.device
        pending = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending, dim=1)
        done = self.cache.lengths[0]
        if done + pending.shape[1] != start:
            raise RuntimeError("drafter context out of step with the target")
        block = torch.tensor([[sequence[-1]] + [self.mask_token_id] * self.max_draft], device=device)
        hidden = self.drafter(
            self.target.embed_tokens(block),
            torch.arange(start, start + self.block_size, device=device)[None],
            pending,
            torch.arange(done, start, device=device)[None],
            cache=self.cache,
        )
        self.pending = []
        keep = self.max_draft if limit is None else min(limit, self.max_draft)
        drafts, confidence = self.read_drafts(hidden[:, 1:])
        return Draft(drafts[0, :keep].tolist(), confidence[0, :keep].tolist())

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows * positions, base vocabulary] of the shared base head, the same for every row."""
        # 2-D on purpose: a 3-D bf16 input took a slow path of the head (44 ms instead of 3 ms); argmax in float32:
        # over bf16 logits it took 2.5 ms for 15 rows, converting first 0.5 ms (same indices)
        return self.lm_head(hidden.reshape(-1, hidden.shape[-1])).float()

    def read_drafts(self, hidden: torch.Tensor, base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts, confidences), each [rows, positions], from the drafter's hidden states at the draft positions
        (`base`: their base-head logits, when already computed for a whole batch)."""
        rows, positions, width = hidden.shape
        flat = hidden.reshape(-1, width)
        logits = self.base_logits(hidden) if base is None else base
        if self.prompt_rows is not None:
            logits = torch.cat([logits, F.linear(flat, self.prompt_rows).float()], dim=-1)
        confidence, drafts = logits.softmax(-1).max(-1)  # softmax keeps the order: the same drafts as argmax
        if self.vocab_ids is not None:
            drafts = self.vocab_ids[drafts]
        return drafts.view(rows, positions), confidence.view(rows, positions)

    @staticmethod
    @torch.inference_mode()
    def propose_batch(proposers: list["DFlashProposer"], sequences: list[list[int]], keep_goings) -> list[Draft]:
        """Every sequence's block in ONE drafter pass, each row over its own context cache."""
        if len(proposers) == 1:
            return [proposers[0].propose(sequences[0])]
        first = proposers[0]
        device = first.drafter.fc.weight.device
        contexts = []
        for p, seq in zip(proposers, sequences):
            pending = p.pending[0] if len(p.pending) == 1 else torch.cat(p.pending, dim=1)
            if p.cache.lengths[0] + pending.shape[1] != len(seq) - 1:
                raise RuntimeError("drafter context out of step with the target")
            contexts.append(pending)
            p.pending = []
        blocks = torch.tensor([[seq[-1]] + [first.mask_token_id] * first.max_draft for seq in sequences], device=device)
        starts = torch.tensor([len(seq) - 1 for seq in sequences], device=device)
        positions = starts[:, None] + torch.arange(first.block_size, device=device)
        hidden = first.drafter.forward_rows(first.target.embed_tokens(blocks), positions, contexts,
                                            [p.cache for p in proposers])
        if first.base_vocab is None:  # one head for every row
            drafts, confidence = first.read_drafts(hidden[:, 1:])
            return [Draft(d, c) for d, c in zip(drafts.tolist(), confidence.tolist())]
        # the base head once for the whole batch (it is every row's), then each row's own prompt tokens
        base = first.base_logits(hidden[:, 1:]).view(len(proposers), first.max_draft, -1)
        made = []
        for r, p in enumerate(proposers):
            drafts, confidence = p.read_drafts(hidden[r: r + 1, 1:], base[r])
            made.append(Draft(drafts[0].tolist(), confidence[0].tolist()))
        return made


def untrained_drafter(target, num_layers: int = 3, block_size: int = 16, seed: int = 0) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        target.config, target.vocab_size, default_mask_token_id(target.tokenizer, target.vocab_size),
        num_layers=num_layers, block_size=block_size,
    )
    return DFlashDrafter.untrained(cfg, seed).to(device=target.device, dtype=target.dtype)


def load_drafter(path: str | Path | None, target, dtype: torch.dtype | None = None,
                 plan=None) -> tuple[DFlashDrafter, str | None]:
    """The drafter at `path`, else the shipped one for this target, else an untrained one (with a note saying so),
    frozen for inference in `dtype` (default: the target's) with `plan`'s kernels (default: the target's)."""
    dtype = dtype or target.dtype
    note = None
    if path is None:
        path = shipped_drafter(target.name, "dflash")
    elif not Path(path).exists():
        raise UserError(f"drafter folder not found: {path}")
    if path is None:
        note = f"no trained drafter ships for {target.name}: using an UNTRAINED drafter (expect tau ~1, no speedup)"
        drafter = untrained_drafter(target).to(dtype)
    else:
        drafter = DFlashDrafter.load(path, dtype=dtype, device=str(target.device))
        drafter.check_fits(target)
    return drafter.freeze(plan or target.kernel_plan), note


def build(target, options: MethodOptions) -> tuple[DFlashProposer, str | None]:
    def make(precision: DraftPrecision) -> tuple[DFlashProposer, str | None]:
        plan = precision.plan_for(target)
        drafter, note = load_drafter(options.drafter, target, precision.dtype, plan)
        return DFlashProposer(drafter, target, options.block_size, plan), note

    return in_draft_dtype("dflash", target, options, make)
