"""The target's own frequent continuations: a second free lookup for the rounds where prompt lookup finds nothing.

The committed corpus of a target (`dflash data`) is its own greedy output on thousands of prompts, so it holds the
target's phrasing ("Let's break this down", "To find the ...", code idioms). A `ContinuationTable` keeps, after each
CONTEXT tokens seen in it, the next token the target produced there most often, where that one was seen at least
MIN_COUNT times and makes at least MIN_SHARE of that context's continuations; a draft chains those. Like prompt
lookup it costs no model pass (a few dict lookups), and the target verifies every token, so the output never
changes. On SmolLM2's answers to the four benchmarks it accepted 0.08-0.34 drafts a position where prompt lookup had
nothing (`scripts/corpus_lookup_estimate.py`); `ngram` tries it after the prompt (docs/METHODS.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

CONTEXT = 3  # tokens of context a continuation is kept for (2 and 4 measured within a few hundredths)
MIN_COUNT, MIN_SHARE = 2, 0.5
TOKEN_BITS = 20  # a context packs its tokens into one int64: vocabularies up to 2^20
TABLE_FILE, INFO_FILE = "table.npz", "table.json"


def _pack(tokens) -> int:
    key = 0
    for t in tokens:
        key = (key << TOKEN_BITS) | t
    return key


class ContinuationTable:
    """context (CONTEXT token ids) -> the next token; `draft` chains them."""

    def __init__(self, contexts: np.ndarray, nexts: np.ndarray, vocab_size: int):
        """`contexts` [n, CONTEXT] and `nexts` [n]: one continuation per context."""
        if vocab_size > 1 << TOKEN_BITS:
            raise ValueError(f"a continuation table holds vocabularies up to {1 << TOKEN_BITS} tokens")
        self.contexts, self.nexts, self.vocab_size = contexts, nexts, vocab_size
        self.source = "built"  # where it came from, for reports (`load`: the folder's name and size)
        keys = np.zeros(len(contexts), dtype=np.int64)
        for j in range(CONTEXT):
            keys = (keys << TOKEN_BITS) | contexts[:, j].astype(np.int64)
        self._next = dict(zip(keys.tolist(), nexts.astype(np.int64).tolist()))

    def __len__(self) -> int:
        return len(self._next)

    @classmethod
    def build(cls, sequences, vocab_size: int, min_count: int = MIN_COUNT,
              min_share: float = MIN_SHARE) -> "ContinuationTable":
        """From token sequences (the target's responses): every CONTEXT-token window and the token after it."""
        windows = [np.lib.stride_tricks.sliding_window_view(np.asarray(s, dtype=np.int64), CONTEXT + 1)
                   for s in sequences if len(s) > CONTEXT]
        if not windows:
            return cls(np.zeros((0, CONTEXT), np.int64), np.zeros(0, np.int64), vocab_size)
        rows = np.unique(np.concatenate(windows), axis=0, return_counts=True)  # sorted by context, then next
        grams, counts = rows
        contexts, nexts = grams[:, :CONTEXT], grams[:, CONTEXT]
        starts = np.flatnonzero(np.r_[True, (contexts[1:] != contexts[:-1]).any(axis=1)])
        ends = np.r_[starts[1:], len(grams)]
        totals = np.add.reduceat(counts, starts)
        best = np.array([a + int(np.argmax(counts[a:b])) for a, b in zip(starts, ends)], dtype=np.int64)
        keep = (counts[best] >= min_count) & (counts[best] >= min_share * totals)
        return cls(contexts[best[keep]], nexts[best[keep]], vocab_size)

    def draft(self, sequence: list[int], count: int) -> list[int]:
        """Up to `count` tokens after `sequence`: each the kept continuation of the CONTEXT tokens before it."""
        if len(sequence) < CONTEXT:
            return []
        window, drafts = list(sequence[-CONTEXT:]), []
        while len(drafts) < count:
            token = self._next.get(_pack(window))
            if token is None:
                break
            drafts.append(token)
            window = window[1:] + [token]
        return drafts

    def save(self, folder: str | Path, info: dict | None = None) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        np.savez_compressed(folder / TABLE_FILE, contexts=self.contexts.astype(dtype), nexts=self.nexts.astype(dtype))
        meta = {"format": "dflash-continuations-1", "context": CONTEXT, "vocab_size": self.vocab_size,
                "entries": len(self), **(info or {})}
        (folder / INFO_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "ContinuationTable":
        folder = Path(folder)
        meta = json.loads((folder / INFO_FILE).read_text())
        if meta.get("format") != "dflash-continuations-1" or meta.get("context") != CONTEXT:
            raise ValueError(f"{folder} does not hold a continuation table of {CONTEXT}-token contexts")
        with np.load(folder / TABLE_FILE) as arrays:
            table = cls(arrays["contexts"].astype(np.int64), arrays["nexts"].astype(np.int64), int(meta["vocab_size"]))
        table.source = f"{folder.name} ({len(table)} contexts)"
        return table


def shipped_table(target) -> ContinuationTable | None:
    """The table shipped for this registry target (its tokenizer's size checked), kept once per process; None where
    none ships or DFLASH_CONTINUATIONS=0."""
    from .base import SHIPPED_DRAFTERS

    if os.environ.get("DFLASH_CONTINUATIONS", "1") == "0":
        return None
    folder = SHIPPED_DRAFTERS / f"{target.name}-continuations"
    if not (folder / INFO_FILE).is_file():
        return None
    if folder not in _SHIPPED:
        _SHIPPED[folder] = ContinuationTable.load(folder)
    table = _SHIPPED[folder]
    return table if table.vocab_size == target.vocab_size else None


_SHIPPED: dict[Path, ContinuationTable] = {}
