"""The transformers fallback: any other Hugging Face causal LM, run through its own forward.

Layer features come from forward hooks on the chosen decoder layers (the OUTPUT of layer i, which HF exposes as
`output_hidden_states[i + 1]`), and the cache is HF's DynamicCache, cropped to roll back. Slower than our own
forward (models/transformer.py), which is why the three tested families never come here; in tests it is also the
reference our forward is checked against.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def cache_keyword(model: nn.Module) -> str:
    """The name under which the model's forward takes its cache: `cache` from transformers 5.2x, where
    `past_key_values` is deprecated (to be removed in 5.40), `past_key_values` before and in remote code."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


class HFCache:
    """HF's DynamicCache with a single row and the KVCache interface the engine uses (lengths, truncate)."""

    batch = 1

    def __init__(self, config):
        from transformers import DynamicCache

        self.inner = DynamicCache(config=config)
        # Sliding-window layers drop old states once full; recording keeps them until we crop, so a rejected
        # block can always be removed.
        self.inner.activate_past_recording()

    @property
    def lengths(self) -> list[int]:
        return [self.inner.get_seq_length()]

    def __len__(self) -> int:
        return self.inner.get_seq_length()

    def truncate(self, length: int) -> None:
        """Drop every cached position >= length. Called after each verify, also with nothing to drop, so sliding
        layers shrink back to their window."""
        current = len(self)
        if length > current:
            raise ValueError(f"cannot truncate a cache of length {current} to {length}")
        self.inner.crop(length - current)

    def set_lengths(self, lengths: list[int]) -> None:
        if len(lengths) != 1:
            raise ValueError("the transformers fallback runs one sequence at a time")
        self.truncate(lengths[0])


class HFEngine:
    """forward(input_ids, cache, feature_layers, logits_at) over the model's own forward."""

    name = "transformers"

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = model.get_decoder().layers
        self.cache_keyword = cache_keyword(model)

    def new_cache(self, batch: int = 1, **_) -> HFCache:
        if batch != 1:
            raise ValueError(f"{type(self.model).__name__} runs through transformers, one sequence at a time")
        return HFCache(self.model.config)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache: HFCache | None, feature_layers: tuple[int, ...] = (),
                 logits_at="all"):
        captured: dict[int, torch.Tensor] = {}

        def hook(layer_id):
            def capture(module, args, output):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output
            return capture

        hooks = [self.layers[i].register_forward_hook(hook(i)) for i in feature_layers]
        try:
            out = self.model(input_ids=input_ids, use_cache=cache is not None,
                             **{self.cache_keyword: cache.inner if cache is not None else None})
        finally:
            for h in hooks:
                h.remove()
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        logits = out.logits
        if isinstance(logits_at, torch.Tensor):
            logits = logits[torch.arange(logits.shape[0], device=logits.device), logits_at][:, None]
        elif logits_at == "last":
            logits = logits[:, -1:]
        elif logits_at == "none":
            logits = None
        return (logits.float() if logits is not None else None), features
