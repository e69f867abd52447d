"""The one speculative decoding loop shared by every proposer (ar, ngram, dflash, eagle3).

prefill -> [propose -> verify the block in one target pass -> accept -> roll back the cache -> feed features back]*

Round bookkeeping: the sequence always ends with the pending *bonus* token (emitted, not yet in the target's cache).
A round verifies [bonus, d_1..d_k]; the target picks t_0..t_k; `a` drafts are accepted; d_1..d_a and t_a are emitted
(a + 1 tokens: the round's tau), the cache keeps bonus and d_1..d_a, and t_a becomes the next bonus.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .errors import UserError
from .methods.base import Proposer
from .sampling import SamplingConfig, accept_length, pick_tokens


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the target's EOS ids
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.sampling.validate()


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    block_size: int = 1
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify round (bonus included)
    draft_lengths: list[int] = field(default_factory=list)  # tokens proposed per round (ngram may propose fewer)
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def num_rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, self.num_rounds)

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of rounds in which draft position k (1..block_size-1) was accepted."""
        rounds = max(1, self.num_rounds)
        return [sum(a - 1 >= k for a in self.accept_lengths) / rounds for k in range(1, self.block_size)]

    @property
    def tau_histogram(self) -> list[int]:
        """Counts of rounds by tokens emitted: index i counts rounds that emitted i + 1 tokens."""
        hist = [0] * self.block_size
        for a in self.accept_lengths:
            hist[min(a, self.block_size) - 1] += 1
        return hist

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first."""
        return 1000 * (self.total_s - self.ttft_s) / max(1, self.new_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(1e-9, self.total_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("num_rounds", "tau", "per_position_acceptance", "tau_histogram", "tpot_ms", "tokens_per_s"):
            d[name] = getattr(self, name)
        return d


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop id or stop string), "length", or "cancelled"
    stats: GenerationStats


class SpeculativeDecoder:
    """Runs `proposer` against `target`; lossless for every proposer (the target decides every token)."""

    def __init__(self, target, proposer: Proposer | None = None):
        self.target = target
        self.proposer = proposer or Proposer()

    def generate(
        self,
        prompt_ids: list[int],
        config: GenerationConfig | None = None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
    ) -> GenerationResult:
        """Generate after `prompt_ids`. `on_tokens(new_ids)` is called as tokens are committed; returning False
        cancels the generation (a streaming client went away)."""
        config = config or GenerationConfig()
        config.validate()
        if not prompt_ids:
            raise UserError("the prompt is empty")
        max_new = min(config.max_new_tokens, self.budget(prompt_ids))
        stop_ids = set(config.stop_token_ids) | (set() if config.ignore_eos else set(self.target.eos_token_ids))
        generator = None
        if config.sampling.seed is not None:
            generator = torch.Generator(device=self.target.device).manual_seed(config.sampling.seed)

        stats = GenerationStats(prompt_tokens=len(prompt_ids), block_size=self.proposer.max_draft + 1)
        t0 = time.perf_counter()
        cache = self.target.new_cache(capacity=len(prompt_ids) + max_new + self.proposer.max_draft + 1)
        device = self.target.device
        out = self.target.forward(torch.tensor([prompt_ids], device=device), cache, self.proposer.feature_layers,
                                  logits_at="last")
        first = pick_tokens(out.logits[0, -1:], config.sampling, generator).tolist()
        self.proposer.start(list(prompt_ids), out.features)
        stats.ttft_s = time.perf_counter() - t0

        sequence = list(prompt_ids) + first
        output: list[int] = []
        finish = None
        new_tokens = first
        while True:
            new_tokens, finish = self._check_stops(output, new_tokens, stop_ids, max_new, config.stop_strings)
            output += new_tokens
            if on_tokens is not None and new_tokens and on_tokens(new_tokens) is False:
                finish = finish or "cancelled"
            if finish:
                break
            new_tokens = self._round(sequence, cache, config.sampling, generator, stats)
            sequence += new_tokens
        stats.total_s = time.perf_counter() - t0
        stats.new_tokens = len(output)
        ends_with_stop_id = finish == "stop" and output[-1] in stop_ids
        text = self.target.decode(output[:-1] if ends_with_stop_id else output)
        text = _cut_at_stop_string(text, config.stop_strings)
        return GenerationResult(tokens=output, text=text, finish_reason=finish, stats=stats)

    def budget(self, prompt_ids: list[int]) -> int:
        """How many tokens may follow `prompt_ids` (a verify block must still fit the context); UserError if none."""
        budget = self.target.max_context - len(prompt_ids) - self.proposer.max_draft - 1
        if budget < 1:
            limit = self.target.max_context - self.proposer.max_draft - 2
            raise UserError(
                f"prompt of {len(prompt_ids)} tokens does not fit the target's context of {self.target.max_context} "
                f"(at most {limit} prompt tokens with this method); shorten the prompt"
            )
        return budget

    def _round(self, sequence, cache, sampling, generator, stats) -> list[int]:
        """One propose/verify/accept round; returns the emitted tokens (accepted drafts + the new bonus)."""
        drafts = self.proposer.propose(sequence).tokens[: self.proposer.max_draft]
        block = [sequence[-1]] + drafts
        start = len(sequence) - 1
        out = self.target.forward(
            torch.tensor([block], device=self.target.device), cache, self.proposer.feature_layers
        )
        chosen = pick_tokens(out.logits[0], sampling, generator).tolist()
        accepted = accept_length(drafts, chosen)
        cache.truncate(start + accepted + 1)
        features = out.features[:, : accepted + 1] if out.features is not None else None
        self.proposer.commit(block[: accepted + 1], features)
        stats.accept_lengths.append(accepted + 1)
        stats.draft_lengths.append(len(drafts))
        return drafts[:accepted] + [chosen[accepted]]

    def _check_stops(self, output, new_tokens, stop_ids, max_new, stop_strings):
        """Cut `new_tokens` at the first stop id, the length limit or a completed stop string."""
        for i, tok in enumerate(new_tokens):
            if tok in stop_ids:
                return new_tokens[: i + 1], "stop"
            if len(output) + i + 1 >= max_new:
                return new_tokens[: i + 1], "length"
        if stop_strings and _has_stop_string(self.target.decode(output + new_tokens), stop_strings):
            for i in range(len(new_tokens)):
                text = self.target.decode(output + new_tokens[: i + 1])
                if _has_stop_string(text, stop_strings):
                    return new_tokens[: i + 1], "stop"
        return new_tokens, None


def _has_stop_string(text: str, stop_strings) -> bool:
    return any(s and s in text for s in stop_strings)


def _cut_at_stop_string(text: str, stop_strings) -> str:
    cut = min((text.find(s) for s in stop_strings if s and s in text), default=-1)
    return text if cut < 0 else text[:cut]
