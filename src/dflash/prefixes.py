"""Prompt prefixes kept from earlier prefills, so a prompt that starts the same way is read only from where it differs.

Chat requests share a lot: the chat template's header and system prompt, the whole conversation so far in a
multi-turn chat (each turn's prompt starts with the previous turn's), and the same prompt for each of a request's
`n` choices. A prefill stores its prompt's keys and values (and the target features a drafter reads) here; a later
prefill copies the longest stored prefix of its prompt into its row and runs the target on the rest only.

The rest is read with the prefix in the cache, as a verify pass reads its block, so its logits equal a whole
prefill's up to float rounding (tested against transformers like every other path). Entries are evicted least
recently used first, to stay within a budget of bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

MIN_PREFIX = 4  # a shorter match is not worth the copy


@dataclass
class CachedPrefix:
    tokens: list[int]
    keys: torch.Tensor  # [layers, kv_heads, len(tokens), head_dim]
    values: torch.Tensor
    features: torch.Tensor | None  # [1, len(tokens), features] for drafters that read the target's features

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values] + ([self.features] if self.features is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def common_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share, by halving over slices compared in C: each prefill compares its
    prompt of up to thousands of tokens with every entry."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class PrefixCache:
    """Stored prompts' keys, values and features, up to `budget_bytes` in all."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # least recently used first
        self.next_key = 0
        self.hits = self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def clear(self) -> None:
        """Forget every stored prefix (a benchmark's cold start); the hit counts stay."""
        self.entries.clear()

    def longest(self, prompt: list[int]) -> tuple[CachedPrefix, int] | None:
        """The entry sharing the longest prefix with `prompt`, and that length (at most len(prompt) - 1: the last
        prompt token is always run, for its logits), or None under MIN_PREFIX."""
        best, best_length = None, 0
        for key, entry in self.entries.items():
            length = min(common_length(entry.tokens, prompt), len(prompt) - 1)
            if length > best_length:
                best, best_length = key, length
        if best is None or best_length < MIN_PREFIX:
            return None
        self.entries.move_to_end(best)
        self.hits, self.hit_tokens = self.hits + 1, self.hit_tokens + best_length
        return self.entries[best], best_length

    def store(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor,
              features: torch.Tensor | None) -> None:
        """Keep a copy of a prompt's keys/values [layers, kv_heads, len(tokens), head_dim] and features. Entries
        that are prefixes of it go: it serves every prompt they served."""
        for key, old in self.entries.items():
            if common_length(old.tokens, tokens) == len(tokens):  # already held, within a longer entry
                self.entries.move_to_end(key)
                return
        entry = CachedPrefix(list(tokens), keys.clone(), values.clone(),
                             None if features is None else features.clone())
        if entry.nbytes > self.budget_bytes:
            return
        for key in [k for k, e in self.entries.items() if common_length(e.tokens, tokens) == len(e.tokens)]:
            del self.entries[key]
        self.entries[self.next_key] = entry
        self.next_key += 1
        while self.nbytes > self.budget_bytes:
            self.entries.popitem(last=False)
