"""A DFlash drafter's pass for one sequence, replayed as a CUDA graph beside the target's (models/graphs.py).

On a GPU the target's steps and verify passes replay as graphs, but the drafter's pass ran eagerly: two layers of
~25 small kernels each, every one paying its launch, and an H100 spent 54 ms a whole-block round (docs/RESULTS.md,
twenty-seventh session). Its graphed form (`DFlashDrafter.forward_static`) takes as static inputs the block's
embeddings and positions and the new context features padded to a graph width (the tokens accepted since the last
draft: 1 to a block's worth, more only after the prompt, which runs eagerly), and writes into the drafter's cache by
scatter. A graph is kept per (cache buffers, width): a proposer keeps its graph-sized cache from one generation to
the next (proposer.py), so one sequence after another replays the same graphs.

Without CUDA (`capture=False`) the same inputs and bookkeeping run the eager static pass: how the CPU tests check
everything but the capture.
"""

from __future__ import annotations

import torch

from ...models.graphs import WIDTHS, CapturedCall, KeptGraphs, padded_width

MAX_GRAPHS = 2 * len(WIDTHS)  # a width each, for a cache or two


class DrafterGraphs(KeptGraphs):
    """`run` is DFlashDrafter.forward with a cache for one sequence, through a graph of its context width."""

    def __init__(self, drafter, capture: bool, compiled: bool = False):
        super().__init__(capture, MAX_GRAPHS)
        self.drafter, self.compiled = drafter, compiled
        # `compiled` (a target run with --compile): the pass through torch.compile, which the graphs capture
        self.forward_static = (torch.compile(drafter.forward_static, dynamic=False) if compiled
                               else drafter.forward_static)

    def handles(self, context_count: int, cache, block_size: int) -> bool:
        """Whether a pass with `context_count` new context tokens can replay: a graph width holds them, and the
        padding's positions (past the block) fit the cache."""
        width = padded_width(context_count)
        return width is not None and cache.batch == 1 and cache.lengths[0] + width + block_size <= cache.capacity

    @torch.inference_mode()
    def run(self, block_embeds: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        """Final hidden states [1, B, hidden] of the block `block_embeds` [1, B, D] after the cache and the new
        context `features` [1, n, n_features * hidden], which the cache then holds (its length moves by n)."""
        n, size = features.shape[1], block_embeds.shape[1]
        width = padded_width(n)
        graph = self._graph(cache, width, size, block_embeds, features)
        done = cache.lengths[0]
        start = done + n  # the block's first position: the bonus token's
        positions = torch.cat([torch.arange(done, start), torch.arange(start + size, start + size + width - n)])
        inputs = graph.inputs
        inputs["block_embeds"].copy_(block_embeds)
        inputs["block_positions"].copy_(torch.arange(start, start + size)[None], non_blocking=True)
        inputs["context_features"][:, :n].copy_(features)
        inputs["context_positions"].copy_(positions[None], non_blocking=True)
        hidden, = self.replay(graph)
        cache.advance(n)
        return hidden.clone()

    def _graph(self, cache, width: int, size: int, block_embeds: torch.Tensor,
               features: torch.Tensor) -> CapturedCall:
        keys, values = cache.keys, cache.values

        def make():
            def run(block_embeds, block_positions, context_features, context_positions):
                return (self.forward_static(block_embeds, block_positions, context_features, context_positions,
                                            keys, values),)

            device = keys.device
            return run, {
                "block_embeds": torch.zeros(1, size, block_embeds.shape[-1], dtype=block_embeds.dtype, device=device),
                "block_positions": torch.zeros(1, size, dtype=torch.long, device=device),
                "context_features": torch.zeros(1, width, features.shape[-1], dtype=features.dtype, device=device),
                "context_positions": torch.zeros(1, width, dtype=torch.long, device=device),
            }

        return self.kept((keys.data_ptr(), values.data_ptr(), tuple(keys.shape), width, size, block_embeds.dtype,
                          features.dtype), make)
