"""Acceptance counted over many generations under vLLM's names (`vllm:spec_decode_*`), so that what was written to
watch vLLM's speculative decoding reads dflash's too: a dashboard on the server's /metrics, or a script that reads
`llm.get_metrics()` (vLLM's offline spec_decode example: mean acceptance length 1 + accepted / drafts, and each
position's acceptance, accepted_per_pos[k] / drafts).

A draft, as vLLM counts it, is one sequence's verify round that checked drafts; a round the controller ran without
drafting (control.py) is not one. Positions count from 0, as vLLM labels them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import GenerationStats


@dataclass
class Counter:
    """vLLM's metrics reader's Counter (vllm.v1.metrics.reader), by its fields."""

    name: str
    labels: dict[str, str]
    value: int


@dataclass
class Vector:
    """vLLM's metrics reader's Vector: a counter per position."""

    name: str
    labels: dict[str, str]
    values: list[int]


def drafted_rounds(stats: "GenerationStats") -> list[tuple[int, int]]:
    """(drafts verified, drafts accepted) of each of a generation's rounds that drafted: vLLM's drafts."""
    return [(drafted, emitted - 1)  # the bonus token is the target's own
            for emitted, drafted in zip(stats.accept_lengths, stats.draft_lengths) if drafted > 0]


@dataclass
class SpecDecodeCounts:
    """What vLLM's spec-decode counters and its prompt and generation token counters hold, for LLM.get_metrics()."""

    positions: int  # the drafts a round verifies at most in a chain (the block size - 1)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # rounds whose draft k was accepted
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.positions

    def add(self, stats: "GenerationStats") -> None:
        """Count one generation's rounds."""
        self.prompt_tokens += stats.prompt_tokens
        self.generation_tokens += stats.new_tokens
        for drafted, accepted in drafted_rounds(stats):
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            for k in range(min(accepted, self.positions)):
                self.accepted_per_pos[k] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's figure: 1 + accepted drafts per round that drafted."""
        return 1 + self.num_accepted_tokens / max(1, self.num_drafts)

    def as_vllm_metrics(self, model_name: str) -> list[Counter | Vector]:
        """What vLLM's `LLM.get_metrics()` lists for these counts, by its names."""
        labels = {"model_name": model_name}
        counters = [("vllm:spec_decode_num_drafts", self.num_drafts),
                    ("vllm:spec_decode_num_draft_tokens", self.num_draft_tokens),
                    ("vllm:spec_decode_num_accepted_tokens", self.num_accepted_tokens),
                    ("vllm:prompt_tokens", self.prompt_tokens),
                    ("vllm:generation_tokens", self.generation_tokens)]
        return [*(Counter(name, dict(labels), value) for name, value in counters),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels), list(self.accepted_per_pos))]
