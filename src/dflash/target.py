"""The target model adapter: any Hugging Face causal LM, with layer features and a KV cache that rolls back.

Feature convention (DFLASH_SPEC.md section 2): the feature of layer i is the OUTPUT of decoder layer i, which HF
exposes as `output_hidden_states[i + 1]` (index 0 is the embedding output). We capture it with forward hooks on the
chosen layers only, so no other hidden state is materialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .errors import UserError
from .hub import DEFAULT_TARGET, REGISTRY, resolve_registry_folder
from .packed import pack_linears

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [batch, seq, vocab], float32
    features: torch.Tensor | None  # [batch, seq, n_layers * hidden] concatenated layer outputs, or None


class KVCache:
    """A thin wrapper over HF's DynamicCache that can be rolled back to any committed length."""

    def __init__(self, config):
        from transformers import DynamicCache

        self.inner = DynamicCache(config=config)
        # Sliding-window layers drop old states once full; recording keeps them until we crop, so a rejected
        # block can always be removed.
        self.inner.activate_past_recording()

    def __len__(self) -> int:
        return self.inner.get_seq_length()

    def truncate(self, length: int) -> None:
        """Drop every cached position >= length. Called after each verify, also with nothing to drop, so sliding
        layers shrink back to their window."""
        current = len(self)
        if length > current:
            raise ValueError(f"cannot truncate a cache of length {current} to {length}")
        self.inner.crop(length - current)


@dataclass
class TargetModel:
    model: nn.Module
    tokenizer: object
    name: str = "target"
    _captured: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.model.eval()
        self.model.requires_grad_(False)
        self._hooks = []

    # ---- shape facts -------------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.get_decoder().layers

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set()
        for source in (self.model.generation_config, self.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(eos)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    # ---- running -------------------------------------------------------------------------------------------
    def pack_linears(self) -> int:
        """Run the frozen target's linears through packed oneDNN kernels on CPU (see packed.py); after any .to()."""
        return pack_linears(self.model)

    def new_cache(self) -> KVCache:
        return KVCache(self.model.config)

    def _hook(self, layer_id: int):
        def capture(module, args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return capture

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, cache: KVCache | None = None, feature_layers: tuple[int, ...] = ()
    ) -> TargetOutput:
        """Run `input_ids` [batch, seq] after what `cache` holds; return logits and the chosen layers' outputs."""
        for layer_id in feature_layers:
            if not 0 <= layer_id < self.num_layers:
                raise UserError(f"feature layer {layer_id} is out of range for a {self.num_layers}-layer target")
        hooks = [self.decoder_layers[i].register_forward_hook(self._hook(i)) for i in feature_layers]
        try:
            out = self.model(
                input_ids=input_ids,
                past_key_values=cache.inner if cache is not None else None,
                use_cache=cache is not None,
            )
        finally:
            for h in hooks:
                h.remove()
        features = None
        if feature_layers:
            features = torch.cat([self._captured[i] for i in feature_layers], dim=-1)
        self._captured.clear()
        return TargetOutput(logits=out.logits.float(), features=features)

    # ---- text -----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for a user prompt; wrapped in the chat template when the tokenizer has one and chat=True."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(prompt)["input_ids"])

    def encode_messages(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            return self.encode_prompt("\n".join(m["content"] for m in messages), chat=False)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def decode(self, ids: list[int]) -> str:
        # Keep special tokens the target chose itself (a generated mask id is real output); stop tokens are cut
        # by the decoding loop before we get here.
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def load_target(spec: str = DEFAULT_TARGET, dtype: str = "float32", device: str = "cpu") -> TargetModel:
    """Load a target from a registry name, a local HF folder, a .gguf file, or a hub id (when online)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked for but CUDA is not available")
    torch_dtype = DTYPES[dtype]
    path = Path(spec).expanduser()
    try:
        if spec in REGISTRY:
            folder = resolve_registry_folder(spec)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
            tokenizer = AutoTokenizer.from_pretrained(folder)
        elif path.suffix == ".gguf":
            if not path.is_file():
                raise UserError(f"GGUF file not found: {path}")
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch_dtype, quantization_config=GgufConfig(dequantize=True)
            )
        elif path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        elif path.exists() or spec.startswith((".", "/", "~")):
            raise UserError(f"target {spec!r} is neither a model folder nor a .gguf file")
        else:  # a hub id: works only online
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype)
            tokenizer = AutoTokenizer.from_pretrained(spec)
    except UserError:
        raise
    except OSError as exc:
        known = ", ".join(REGISTRY)
        raise UserError(f"could not load target {spec!r} ({exc.__class__.__name__}); registry names: {known}") from exc
    target = TargetModel(model=model.to(device), tokenizer=tokenizer, name=spec)
    target.pack_linears()
    return target
