"""Draft trees: several candidates per position verified in ONE target pass, with a tree attention mask.

A block drafter (DFlash) gives a distribution at every block position. A chain verifies its top-1 token at each;
a tree keeps the top-k of each position and grows best first by the product of the drafter's probabilities along a
path, so a node budget goes where acceptance is likely (mostly the first few positions, where a chain's second
guess is often right). The target verifies all nodes in one pass: a node sees the cached context and its own
ancestors, at the position of its depth. The round then walks the tree from the root (the pending bonus token),
descending into the child that holds the target's token at each node, exactly as a chain round accepts its
longest correct prefix; the accepted path's keys and values are moved into consecutive cache slots.

A block's nodes: index 0 is the root (the bonus), node i > 0 is draft i - 1; `parents[i]` is the index of its
parent (-1 for the root), always below i. A chain is the tree whose parents are [-1, 0, 1, 2, ...].

`scripts/tree_estimate.py` measured what trees bring before they were built (GSM8K, 8 prompts, 128 tokens, the
stage-14 drafter): tau 1.90 for the chain of 15 drafts, 2.55 for 15 nodes of the top 8, 2.90 for 63 nodes.
"""

from __future__ import annotations

import heapq
from typing import Callable

import torch

MAX_TREE_TOKENS = 64  # a node's visibility is one 64-bit word (native.c)


def best_first(candidates: list[list[tuple[int, float]]], nodes: int) -> tuple[list[int], list[int], list[float]]:
    """The `nodes` paths of largest probability product, where candidates[d] lists the (token, probability) pairs
    of draft position d + 1. Returns (tokens, parents, path probabilities) of the drafts in the order they were
    kept: a path's product never exceeds its prefix's, so every parent comes before its children."""
    tokens: list[int] = []
    parents: list[int] = []
    probabilities: list[float] = []
    heap = [(-p, order, 0, 0, t) for order, (t, p) in enumerate(candidates[0])]  # (-product, tiebreak, depth, parent)
    heapq.heapify(heap)
    order = len(heap)
    while heap and len(tokens) < nodes:
        negative, _, depth, parent, token = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        probabilities.append(-negative)
        node = len(tokens)  # its index in the block
        if depth + 1 < len(candidates):
            for t, p in candidates[depth + 1]:
                heapq.heappush(heap, (negative * p, order, depth + 1, node, t))
                order += 1
    return tokens, parents, probabilities


def depths(parents: list[int]) -> list[int]:
    out = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def visibility(parents: list[int]) -> list[int]:
    """Per node, the bits of the nodes it attends to in the pass: its ancestors and itself."""
    bits: list[int] = []
    for i, parent in enumerate(parents):
        bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
    return bits


def as_int64(bits: list[list[int]]) -> torch.Tensor:
    """Rows of 64-bit words as an int64 tensor (bit 63 as the sign bit), for native.c."""
    return torch.tensor([[b - (1 << 64) if b >= 1 << 63 else b for b in row] for row in bits], dtype=torch.int64)


def ancestors(parents: list[list[int]], width: int) -> torch.Tensor:
    """Bool [b, width, width]: node i of row r attends to the pass's node j (its ancestors and itself); rows
    shorter than `width` (a graph's padded width) get padding nodes under the root, seeing it and themselves."""
    out = torch.zeros(len(parents), width, width, dtype=torch.bool)
    for r, row in enumerate(parents):
        for i, parent in enumerate(list(row) + [0] * (width - len(row))):
            if parent >= 0:
                out[r, i] = out[r, parent]  # a parent comes before its children
            out[r, i, i] = True
    return out


def tree_mask(positions: torch.Tensor, starts: torch.Tensor, visible: torch.Tensor, key_count: int,
              window: int | None = None) -> torch.Tensor:
    """The mask of a tree pass through torch's layers, eager or graphed (device tensors only, no host sync): bool
    [b, 1, n, key_count], node i of row r seeing the cached keys before starts[r] (within `window` of its position)
    and, among the pass's slots starts[r]..starts[r] + n - 1, those `visible` [b, n, n] marks."""
    b, n = positions.shape
    keys = torch.arange(key_count, device=positions.device)
    offset = keys[None, None, :] - starts[:, None, None]  # [b, 1, keys]: a key's slot within the pass
    before = (offset < 0).expand(b, n, key_count)
    if window is not None:
        before = before & (keys > positions[..., None] - window)
    inside = (offset >= 0) & (offset < n)
    seen = visible.gather(2, offset.clamp(0, n - 1).expand(b, n, key_count))
    return (before | (inside & seen))[:, None]


def walk(parents: list[int], tokens: list[int], choose: Callable[[list[int]], int]) -> tuple[list[int], int]:
    """The accepted path, node indices from the root, and the target's token after it: from the root, `choose(path)`
    gives the target's token at the path's last node (greedy or sampled given the path), and the walk descends into
    the child holding it while there is one. `tokens[i]` is node i's token (the root's is not read)."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], {}).setdefault(tokens[i], i)
    path = [0]
    while True:
        token = choose(path)
        child = children.get(path[-1], {}).get(token)
        if child is None:
            return path, token
        path.append(child)
