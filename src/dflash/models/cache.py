"""One key/value cache for every model: preallocated buffers written by position (gpt-fast's design).

Rolling back is setting a length: positions past it hold stale keys that attention never reads (masks and views stop
at the length) and the next write overwrites. No tensor is concatenated or cropped per round. Each row of a batch has
its own length, so a batch may be ragged (rows that accepted different numbers of drafts).

The target engine writes every layer's keys/values of new tokens; the DFlash drafter keeps the keys/values of the
injected target features (its block's own go past the committed length and are dropped by not moving it); the
EAGLE-3 head keeps those of its pairs the same way.
"""

from __future__ import annotations

import torch

from . import memory

GROWTH_STEP = 256


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host caches go on huge pages (memory.py): attention streams them, a batched step ~440 MB of them."""
    if torch.device(device).type == "cpu":
        return memory.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def scatter_index(positions: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The index of a layer's buffer [b, kv_heads, capacity, d] at which keys/values [b, kv_heads, n, d] of tokens at
    `positions` [b, n] (a device tensor) go: `buffer[index] = k`, no host sync (a graphed pass's write). Made once
    per pass, used by every layer."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None, None]
    heads = torch.arange(kv_heads, device=positions.device)[None, :, None]
    return rows, heads, positions[:, None, :]


class KVCache:
    """keys/values: [layers, batch, kv_heads, capacity, head_dim]; `lengths[r]`: positions of row r in use."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", batch: int = 1, capacity: int = GROWTH_STEP,
                 max_capacity: int | None = None):
        self.shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.keys = _zeros(self.shape, dtype, device)
        self.values = _zeros(self.shape, dtype, device)
        self.lengths = [0] * batch
        self.max_capacity = max_capacity

    # ---- sizes ---------------------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def __len__(self) -> int:
        """The length of a single-row cache (the batch-1 engine's view)."""
        if self.batch != 1:
            raise TypeError("len() of a batched cache is ambiguous; read .lengths")
        return self.lengths[0]

    def reserve(self, end: int) -> None:
        """Make room for positions < `end` (grows in steps, copying what is cached)."""
        if end <= self.capacity:
            return
        if self.max_capacity is not None and end > self.max_capacity:
            raise ValueError(f"cache capacity {self.max_capacity} exceeded (asked for {end} positions)")
        capacity = -(-max(end, 2 * self.capacity) // GROWTH_STEP) * GROWTH_STEP
        if self.max_capacity is not None:
            capacity = min(capacity, self.max_capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = _zeros((*old.shape[:3], capacity, old.shape[4]), old.dtype, old.device)
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)

    # ---- writing and reading -------------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [batch, kv_heads, n, head_dim] of `layer` at each row's positions lengths[r] + offset onward
        (call `reserve` first) and return that layer's keys/values up to the longest row's new end. Lengths do not
        move: `advance` does that once per forward, after every layer has written."""
        n = k.shape[2]
        starts = [length + offset for length in self.lengths] if offset else self.lengths
        end = max(starts) + n
        keys, values = self.keys[layer], self.values[layer]
        if all(s == starts[0] for s in starts):
            keys[:, :, starts[0]: end] = k
            values[:, :, starts[0]: end] = v
        else:  # ragged rows: each at its own offset
            rows = torch.arange(self.batch, device=k.device)[:, None, None]
            heads = torch.arange(k.shape[1], device=k.device)[None, :, None]
            positions = (torch.tensor(starts, device=k.device)[:, None] + torch.arange(n, device=k.device))[:, None]
            keys[rows, heads, positions] = k
            values[rows, heads, positions] = v
        return keys[:, :, :end], values[:, :, :end]

    def read(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        end = max(self.lengths) if end is None else end
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.lengths = [length + n for length in self.lengths]

    def truncate(self, length: int) -> None:
        """Roll a single-row cache back to `length` positions."""
        if self.batch != 1:
            raise TypeError("truncate() is for single-row caches; use set_lengths")
        self.set_lengths([length])

    def set_lengths(self, lengths: list[int]) -> None:
        """Roll rows back to these lengths (never forward: positions past a length may hold stale keys)."""
        if len(lengths) != self.batch:
            raise ValueError(f"{len(lengths)} lengths for a batch of {self.batch}")
        if any(not 0 <= new <= old for new, old in zip(lengths, self.lengths)):
            raise ValueError(f"cannot roll lengths {self.lengths} to {lengths}: rollback only shortens")
        self.lengths = list(lengths)

    def keep_path(self, row: int, start: int, path: list[int]) -> None:
        """After a tree pass from slot `start` of `row`: move the keys/values of the accepted path's nodes (their
        indices in the pass, increasing) into consecutive slots start, start + 1, ... (each already sits at the
        position of its depth; gathered before written, so a node's move never overwrites one still to move)."""
        if path == list(range(len(path))):
            return
        device = self.keys.device
        source = torch.tensor([start + node for node in path], device=device)
        dest = torch.arange(start, start + len(path), device=device)
        self.keys[:, row, :, dest] = self.keys[:, row, :, source]
        self.values[:, row, :, dest] = self.values[:, row, :, source]

    # ---- rows ------------------------------------------------------------------------------------------------------
    def view(self, start: int, stop: int, spare_after: bool = False) -> "KVCache":
        """Rows start..stop-1 as a cache sharing this one's storage (writes land here). A view cannot grow: reserve
        room on this cache first. Its lengths are its own list; copy them back with `take_lengths`. `spare_after`:
        the rows after it hold nothing (a packed batch's free rows), so a padded pass may write there (`widened`)."""
        view = KVCache.__new__(KVCache)
        view.shape = self.shape
        view.keys, view.values = self.keys[:, start:stop], self.values[:, start:stop]
        view.lengths = self.lengths[start:stop]
        view.max_capacity = self.capacity
        view.rows_of = (self, start) if spare_after else None  # a graphed pass may widen it (graphs.py)
        return view

    def widened(self, rows: int) -> "KVCache | None":
        """This view widened to `rows` rows of the cache it views (the rows past its own at length 0: spare rows
        a padded pass may write into), or None where that cache has no such rows."""
        parent, start = getattr(self, "rows_of", None) or (None, 0)
        if parent is None or start + rows > parent.batch:
            return None
        wide = parent.view(start, start + rows)
        wide.lengths = self.lengths + [0] * (rows - self.batch)
        return wide

    def take_lengths(self, view: "KVCache", start: int) -> None:
        """Adopt the lengths a view of rows start.. ended with."""
        self.lengths[start: start + view.batch] = view.lengths

    def move_row(self, source: int, dest: int) -> None:
        """Copy row `source` (up to its length) into row `dest`: a batch stays packed when a sequence leaves."""
        length = self.lengths[source]
        self.keys[:, dest, :, :length] = self.keys[:, source, :, :length]
        self.values[:, dest, :, :length] = self.values[:, source, :, :length]
        self.lengths[dest] = length
