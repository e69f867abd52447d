"""Target passes replayed as CUDA graphs (the way gpt-fast and vLLM decode on a GPU).

A decode step of a small model on a GPU is bound by launching its kernels: SmolLM2-135M runs ~300 small kernels per
step, a few microseconds of Python and launch each, against well under a millisecond of GPU work. A CUDA graph
records those launches once and replays them with one call. The price is that the replayed pass must not depend on
anything the host decides per call: no Python-side lengths, no shapes that change, no allocation, no host sync.

So the graphed pass (`Transformer.forward_static`) reads its tokens' positions from a device tensor, writes keys and
values into the cache by scatter at those positions, and attends over the cache's whole capacity through a mask
computed on the device (key position <= query position, within the window). Each (rows, width, feature layers,
cache buffers) gets its own graph, captured at first use; widths are padded up to WIDTHS so that the adaptive
controller's 1..17-token passes need five graphs per batch size, not seventeen (padding tokens are computed and
dropped, their cache entries lie past the row's length and are overwritten later, as in the engine's ragged
batches). A batch's rows are padded likewise, to the next power of two, where its cache has free rows after the
ones in use (the engine keeps its rows packed): a batch that grows and shrinks replays a few graphs a width instead
of capturing one per row count. A cache that grows reallocates its buffers, and the graphs of the old ones are
dropped: give the cache its final capacity up front (`TargetModel.new_cache` does when graphs are on).

Without CUDA (`capture=False`), the same buffers and bookkeeping run the eager pass instead of a replay: that is
how the CPU tests check everything here but the capture itself.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import torch

# a pass of n tokens per row runs in the graph of the smallest width >= n; 64: a draft tree's widest pass (trees.py)
WIDTHS = (1, 2, 4, 8, 16, 32, 64)
MAX_GRAPHS = 56  # graphs kept (least recently used dropped): 7 widths x up to 8 row counts (1, 2, 4, .. 128)


def padded_width(n: int) -> int | None:
    """The graph width a pass of `n` tokens per row runs at, or None when wider than any (it runs eagerly)."""
    return next((w for w in WIDTHS if w >= n), None)


def padded_rows(rows: int) -> int:
    """The row count a batched pass of `rows` rows runs at where its cache has spare rows: the next power of two, so
    that a batch growing and shrinking between 1 and 64 rows replays 7 graphs a width, not 64."""
    return 1 << (rows - 1).bit_length()


class CapturedCall:
    """One graphed call: its static inputs (buffers the caller fills before each replay), its static outputs (a tuple
    of tensors or Nones: what `run(**inputs)` returns) and how to replay it. The target's passes are such calls, and
    so is a DFlash drafter's (methods/dflash/graphs.py)."""

    def __init__(self, run: Callable[..., tuple], inputs: dict[str, torch.Tensor], capture: bool):
        self.inputs, self.run, self.capture, self.graph = inputs, run, capture, None
        self.outputs: tuple | None = None

    def _capture(self, pool) -> None:
        """Record the call. Called with the first call's inputs already in place: the warm-up calls write what that
        call writes anyway (a pass: keys and values at its own positions, past every row's length), never zeros
        over cached positions."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: lazy library handles, autotuning
            for _ in range(2):
                self.run(**self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = self.run(**self.inputs)

    def replay(self, pool=None):
        """Run the call on the current inputs (capturing it first when due); returns the graph's memory pool."""
        if self.capture and self.graph is None:
            self._capture(pool)
        if self.graph is not None:
            self.graph.replay()
            return self.graph.pool()
        outputs = self.run(**self.inputs)  # no CUDA: eager, into the same static outputs
        if self.outputs is None:
            self.outputs = outputs
        else:  # as a replay overwrites the graph's outputs (what callers must not keep)
            with torch.inference_mode():
                for kept, new in zip(self.outputs, outputs):
                    if kept is not None:
                        kept.copy_(new)
        return pool


class KeptGraphs:
    """Graphed calls kept by key (the least recently used dropped past `max_graphs`: a graph holds its cache's
    buffers and its own outputs), all replayed through one memory pool."""

    def __init__(self, capture: bool, max_graphs: int):
        self.capture, self.max_graphs = capture, max_graphs
        self.graphs: OrderedDict[tuple, CapturedCall] = OrderedDict()
        self.pool = None
        self.captures = 0  # graphs made so far (a report, and what tests count)
        self.capture_seconds = 0.0  # spent capturing them (their warm-up calls, and any compiling, included)

    def kept(self, key: tuple, make: Callable[[], tuple[Callable[..., tuple], dict[str, torch.Tensor]]]
             ) -> CapturedCall:
        """The graph kept under `key`, or a new one of `make()`'s (run, static inputs), captured at its first replay."""
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return graph
        graph = CapturedCall(*make(), self.capture)
        self.captures += 1
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return graph

    def replay(self, graph: CapturedCall) -> tuple:
        """Run `graph` on its current inputs; its outputs (overwritten by its next replay)."""
        capturing = graph.capture and graph.graph is None
        started = time.perf_counter()
        self.pool = graph.replay(self.pool)
        if capturing:
            self.capture_seconds += time.perf_counter() - started
        return graph.outputs

    def report(self) -> dict:
        return {"graphs": self.captures, "capture_seconds": round(self.capture_seconds, 2)}


class PassGraphs(KeptGraphs):
    """The graphed passes of one target: `run(input_ids, cache, feature_layers)` is `Transformer.forward` for a
    pass of up to max(WIDTHS) tokens per row, through a captured graph of its shape (made on first use)."""

    def __init__(self, engine, capture: bool | None = None, max_graphs: int = MAX_GRAPHS):
        super().__init__(torch.cuda.is_available() if capture is None else capture, max_graphs)
        self.engine = engine

    def handles(self, input_ids: torch.Tensor, cache) -> bool:
        """Whether this pass can run graphed: a pass of at most max(WIDTHS) tokens per row whose padded width still
        fits the cache (a graph never grows it)."""
        width = padded_width(input_ids.shape[1])
        return width is not None and max(cache.lengths) + width <= cache.capacity

    def run(self, input_ids: torch.Tensor, cache, feature_layers: tuple[int, ...] = (),
            tree: torch.Tensor | None = None):
        """(logits [b, n, vocab] float32, features [b, n, len(feature_layers) * hidden] or None) of `input_ids`
        [b, n] after each row's cached tokens; the cache advances by n, as with `Transformer.forward`. `tree`: the
        parents [b, n] of a tree pass (trees.py; graphs of their own, the padding nodes leaves under the root). The
        outputs are copies: the next replay overwrites the graph's own."""
        from .. import trees

        rows, n = input_ids.shape
        width = padded_width(n)
        # a batch's view with free rows after it runs at a padded row count, its padding rows at length 0
        wide = cache.widened(padded_rows(rows)) if padded_rows(rows) > rows else None
        runs_on = wide if wide is not None else cache
        graph = self._graph(runs_on, runs_on.batch, width, tuple(feature_layers), tree is not None)
        starts = torch.tensor(runs_on.lengths, dtype=torch.long)
        slots = starts[:, None] + torch.arange(width)
        padded = torch.cat([input_ids, input_ids[:, -1:].expand(rows, width - n)], dim=1) if width > n else input_ids
        if runs_on.batch > rows:
            padded = torch.cat([padded, padded[-1:].expand(runs_on.batch - rows, width)])
        graph.inputs["ids"].copy_(padded, non_blocking=True)
        if tree is None:
            graph.inputs["positions"].copy_(slots, non_blocking=True)
        else:
            parents = tree.tolist() + [[-1]] * (runs_on.batch - rows)
            parents = [row + [0] * (width - len(row)) for row in parents]
            depths = torch.tensor([trees.depths(row) for row in parents])
            graph.inputs["positions"].copy_(starts[:, None] + depths, non_blocking=True)
            graph.inputs["slots"].copy_(slots, non_blocking=True)
            graph.inputs["starts"].copy_(starts, non_blocking=True)
            graph.inputs["visible"].copy_(trees.ancestors(parents, width), non_blocking=True)
        logits, features = self.replay(graph)
        cache.advance(n)  # the padding's keys lie past the new lengths (or in free rows): never read
        return logits[:rows, :n].clone(), (features[:rows, :n].clone() if features is not None else None)

    def _graph(self, cache, rows: int, width: int, feature_layers: tuple[int, ...], tree: bool = False
               ) -> CapturedCall:
        keys, values = cache.keys, cache.values

        def make():
            def run(ids, positions, **tree_inputs):
                return self.engine.forward_static(ids, positions, keys, values, feature_layers, **tree_inputs)

            device = keys.device
            inputs = {name: torch.zeros(rows, width, dtype=torch.long, device=device)
                      for name in ("ids", "positions") + (("slots",) if tree else ())}
            if tree:
                inputs["starts"] = torch.zeros(rows, dtype=torch.long, device=device)
                inputs["visible"] = torch.zeros(rows, width, width, dtype=torch.bool, device=device)
            return run, inputs

        return self.kept((keys.data_ptr(), values.data_ptr(), tuple(keys.shape), tuple(keys.stride()), rows, width,
                          feature_layers, tree), make)
