"""The target's own frequent continuations: a second free lookup for the rounds where prompt lookup finds nothing.

The committed corpus of a target (`dflash data`) is its own greedy output on thousands of prompts, so it holds the
target's phrasing ("Let's break this down", "To find the ...", code idioms). A `ContinuationTable` keeps, after each
context of L tokens seen in it (L in CONTEXTS), the next token the target produced there most often, where that one
was seen at least MIN_COUNT times and makes at least MIN_SHARE of that context's continuations. A draft chains
those, each token from the longest context the table knows (a back-off n-gram model of the target). Like prompt
lookup it costs no model pass (a few dict lookups), and the target verifies every token, so the output never
changes. `ngram` tries it after the prompt's longer matches (docs/METHODS.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import UserError

# Context lengths, longest first. Over SmolLM2's greedy answers to the four benchmarks, drafts from 8/5/3/2-token
# contexts were accepted 0.05-0.20 tokens a position more than from 3-token ones alone
# (scripts/corpus_lookup_estimate.py; more lengths, 8/6/5/4/3/2 or up to 12, drafted within 0.02 of these).
CONTEXTS = (8, 5, 3, 2)
MIN_COUNT, MIN_SHARE = 2, 0.5
TOKEN_BITS = 20  # a context packs its tokens into one integer: vocabularies up to 2^20
TABLE_FILE, INFO_FILE = "table.npz", "table.json"
FORMAT = "dflash-continuations-2"


def _pack(tokens) -> int:
    key = 0
    for t in tokens:
        key = (key << TOKEN_BITS) | t
    return key


def _pack_rows(rows: np.ndarray) -> list[int]:
    """`_pack` of each row of [n, L] token ids: up to 3 tokens (60 bits) at a time in numpy, joined in Python."""
    parts = []
    for end in range(rows.shape[1], 0, -3):  # from the right: the last tokens take the lowest bits
        packed = np.zeros(len(rows), dtype=np.int64)
        for j in range(max(0, end - 3), end):
            packed = (packed << TOKEN_BITS) | rows[:, j].astype(np.int64)
        parts.append(packed.tolist())
    if len(parts) == 1:
        return parts[0]
    shifts = [3 * TOKEN_BITS * i for i in range(len(parts))]
    return [sum(p << s for p, s in zip(chunks, shifts)) for chunks in zip(*parts)]


def frequent_continuations(sequences, length: int, min_count: int = MIN_COUNT,
                           min_share: float = MIN_SHARE) -> tuple[np.ndarray, np.ndarray]:
    """(contexts [n, length], nexts [n]): each context of `sequences` with its most frequent next token, where that
    one was seen at least `min_count` times and is at least `min_share` of the context's continuations."""
    windows = [np.lib.stride_tricks.sliding_window_view(np.asarray(s, dtype=np.int64), length + 1)
               for s in sequences if len(s) > length]
    if not windows:
        return np.zeros((0, length), np.int64), np.zeros(0, np.int64)
    grams, counts = np.unique(np.concatenate(windows), axis=0, return_counts=True)  # by context, then next
    contexts, nexts = grams[:, :length], grams[:, length]
    starts = np.flatnonzero(np.r_[True, (contexts[1:] != contexts[:-1]).any(axis=1)])
    totals = np.add.reduceat(counts, starts)
    best = np.array([a + int(np.argmax(counts[a:b])) for a, b in zip(starts, np.r_[starts[1:], len(grams)])],
                    dtype=np.int64)
    keep = (counts[best] >= min_count) & (counts[best] >= min_share * totals)
    return contexts[best[keep]], nexts[best[keep]]


class ContinuationTable:
    """contexts of several lengths -> the next token; `draft` chains them, each from the longest context known."""

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray]], vocab_size: int):
        """`tables`: context length -> (contexts [n, length], nexts [n]), one continuation per context."""
        if vocab_size > 1 << TOKEN_BITS:
            raise ValueError(f"a continuation table holds vocabularies up to {1 << TOKEN_BITS} tokens")
        self.tables, self.vocab_size = tables, vocab_size
        self.source = "built"  # where it came from, for reports (`load`: the folder's name and size)
        self.lengths = sorted(tables, reverse=True)
        self._next = {length: dict(zip(_pack_rows(contexts), nexts.astype(np.int64).tolist()))
                      for length, (contexts, nexts) in tables.items()}

    def __len__(self) -> int:
        return sum(map(len, self._next.values()))

    @classmethod
    def build(cls, sequences, vocab_size: int, lengths=CONTEXTS, min_count: int = MIN_COUNT,
              min_share: float = MIN_SHARE) -> "ContinuationTable":
        """From token sequences (the target's responses). A longer context is kept only where it continues
        otherwise than the shorter ones would: the drafts are the same, from a third of the entries."""
        sequences = [list(s) for s in sequences]
        table = cls({}, vocab_size)
        for length in sorted(lengths):
            contexts, nexts = frequent_continuations(sequences, length, min_count, min_share)
            differs = np.array([table.continuation(row) != nxt for row, nxt in zip(contexts.tolist(), nexts.tolist())],
                               dtype=bool)
            table = cls({**table.tables, length: (contexts[differs], nexts[differs])}, vocab_size)
        return table

    def continuation(self, window: list[int]) -> int | None:
        """The next token after `window`, from the longest of its last tokens the table holds a context for."""
        keys, key = {}, 0
        for distance in range(min(len(window), self.lengths[0] if self.lengths else 0)):
            key |= window[-1 - distance] << (TOKEN_BITS * distance)
            keys[distance + 1] = key
        for length in self.lengths:
            if length in keys:
                token = self._next[length].get(keys[length])
                if token is not None:
                    return token
        return None

    def draft(self, sequence: list[int], count: int) -> list[int]:
        """Up to `count` tokens after `sequence`, each the continuation of the tokens before it."""
        window, drafts = list(sequence[-self.lengths[0]:]) if self.lengths else [], []
        while len(drafts) < count:
            token = self.continuation(window)
            if token is None:
                break
            drafts.append(token)
            window = window[1:] + [token] if len(window) == self.lengths[0] else window + [token]
        return drafts

    def save(self, folder: str | Path, info: dict | None = None) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        arrays = {}
        for length, (contexts, nexts) in self.tables.items():
            arrays[f"contexts{length}"], arrays[f"nexts{length}"] = contexts.astype(dtype), nexts.astype(dtype)
        np.savez_compressed(folder / TABLE_FILE, **arrays)
        meta = {"format": FORMAT, "contexts": sorted(self.tables, reverse=True), "vocab_size": self.vocab_size,
                "entries": len(self), **(info or {})}
        (folder / INFO_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "ContinuationTable":
        folder = Path(folder)
        meta = json.loads((folder / INFO_FILE).read_text())
        with np.load(folder / TABLE_FILE) as arrays:
            if meta.get("format") == FORMAT:
                tables = {int(n): (arrays[f"contexts{n}"].astype(np.int64), arrays[f"nexts{n}"].astype(np.int64))
                          for n in meta["contexts"]}
            elif meta.get("format") == "dflash-continuations-1":  # one context length (the twentieth session's)
                tables = {int(meta["context"]): (arrays["contexts"].astype(np.int64),
                                                  arrays["nexts"].astype(np.int64))}
            else:
                raise ValueError(f"{folder} does not hold a continuation table ({meta.get('format')!r})")
        table = cls(tables, int(meta["vocab_size"]))
        table.source = f"{folder.name} ({len(table)} contexts)"
        return table


OFF = "none"  # --continuations none: prompt lookup alone


def table_for(target, choice: str | None = None) -> ContinuationTable | None:
    """The table prompt lookup drafts from: `choice` names a folder (`dflash data --out DIR --table FOLDER` builds
    one from a target's regenerated corpus), "none" for none, None for the one shipped for the target."""
    if choice is None:
        return shipped_table(target)
    if choice == OFF:
        return None
    folder = Path(choice)
    if not (folder / INFO_FILE).is_file():
        raise UserError(f"--continuations {choice}: no continuation table there (no {INFO_FILE}; "
                        f"`dflash data --out DATA_FOLDER --table {choice}` builds one)")
    try:
        table = ContinuationTable.load(folder)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"--continuations {choice}: {exc}") from exc
    if table.vocab_size != target.vocab_size:
        raise UserError(f"--continuations {choice}: the table is for a vocabulary of {table.vocab_size} tokens, "
                        f"the target has {target.vocab_size}")
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
