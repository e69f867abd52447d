"""The target model adapter: a Hugging Face causal LM run through our own forward where its family is supported
(models/transformer.py: Llama, Qwen2, Qwen3, Gemma3), else through transformers (models/hf.py).

Feature convention (DFLASH_SPEC.md section 2): the feature of layer i is the OUTPUT of decoder layer i, which HF
exposes as `output_hidden_states[i + 1]` (index 0 is the embedding output).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from ..hub import DEFAULT_TARGET, REGISTRY, close_registry_names, hub_reachable, resolve_registry_folder
from .hf import HFEngine
from .graphs import PassGraphs
from . import native, sdpa_backends
from .kernels import NATIVE, PACKED, PLAIN, STALE_RATIO, KernelPlan, kernel_plan_for, shape_key
from .transformer import EVERY_PROMPT, PROMPT_CHUNKS, Transformer, Unsupported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a target's precisions: DTYPES, and int8 weights in its decoder layers with bfloat16 activations (quantize_int8)
TARGET_DTYPES = {**DTYPES, "int8": torch.bfloat16}
KERNEL_CHOICES = ("auto", "packed", "plain", "native")
PROMPT_LENGTHS = (64, 384)  # the prompt lengths at which the C stack is timed against torch's layers
# ... and once more, where the C stack won at 384: its attention costs a token more as the context grows, and on an
# Intel Xeon with AMX (fifty-fourth session) it took 0.92x-0.97x torch's time at 300 tokens, 1.01x-1.13x at 1024 and
# 1.15x-1.38x at 2048 in float32, bfloat16 and int8 alike, so a choice made at 384 alone sent long prompts the slow way
LONG_PROMPT = 1024


# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


@dataclass
class TemplateOptions:
    """How a conversation goes through the chat template, as vLLM's and SGLang's chat requests say it: `kwargs`
    the template's own variables (Qwen3's enable_thinking), `continue_final_message` to go on with the last
    assistant turn instead of opening a new one (a reply's start written for the target)."""

    kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template: str | None = None  # a Jinja chat template in place of the tokenizer's own, for this conversation

    def check(self, messages: list[dict]) -> None:
        if not isinstance(self.kwargs, dict):
            raise UserError("chat_template_kwargs must be an object")
        taken = sorted(set(self.kwargs) & TEMPLATE_ARGUMENTS)
        if taken:
            raise UserError(f"chat_template_kwargs may not set {', '.join(taken)} (fields of their own)")
        if self.continue_final_message and self.add_generation_prompt:
            raise UserError("continue_final_message goes on with the last assistant turn: send it with "
                            "add_generation_prompt false")
        if self.continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise UserError("continue_final_message needs an assistant message last")


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [batch, positions, vocab], float32
    features: torch.Tensor | None  # [batch, seq, n_layers * hidden] concatenated layer outputs, or None
    hidden: torch.Tensor | None = None  # [batch, seq, hidden]: the last layer's output, when logits_at="hidden"


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # sampling_defaults' keys


@dataclass
class TargetModel:
    model: nn.Module
    tokenizer: object
    name: str = "target"
    kernel_plan: KernelPlan = field(default_factory=lambda: PACKED)
    kernel_report: dict = field(default_factory=dict)  # how the kernels were chosen (for --json and bench)
    prefer_transformers: bool = False  # run through transformers even where our forward exists
    measure: bool = True  # choose kernels and draft dtypes by timing them (off for the tiny test targets)
    # release each decoder weight's plain copy as its kernels' copy is laid out (release_plain_weights): for
    # processes whose every pass runs our forward (the CLI's, but bench with `hf`)
    release_plain: bool = False
    _engine: object = field(default=None, repr=False)
    graphs: PassGraphs | None = field(default=None, repr=False)  # set by use_graphs
    graph_capacity: int = 0  # the cache capacity graphs are made for (new caches get at least this)
    graphs_compiled: bool = False  # the graphed passes run through torch.compile (compile_graphs)
    defer_logits: bool = True  # let verify passes compute their logits a few positions at a time (defers_logits)
    screen_greedy: bool | None = None  # greedy tokens through the head's screen (None: not decided; engine.py times it)
    screen_kind: str = "bfloat16"  # which screen (models/screening.py KINDS), chosen with screen_greedy
    int8: bool = False  # its decoder layers' weights are int8 (quantize_int8)
    context_limit: int | None = None  # a shorter context than the model's (serve's --max-model-len; limit_context)
    _step_ms_now: float | None = field(default=None, repr=False)  # a 1-token pass timed in this process (cached_timing)

    def __post_init__(self):
        self.model.eval()
        self.model.requires_grad_(False)

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
    def native_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def max_context(self) -> int:
        return self.native_context if self.context_limit is None else min(self.native_context, self.context_limit)

    def limit_context(self, tokens: int | None) -> None:
        """Prompt and output together stay within `tokens` (vLLM's --max-model-len: a cap on each request's cache
        memory); None: the model's own context."""
        if tokens is not None and not 64 <= tokens <= self.native_context:
            raise UserError(f"max_model_len must be in [64, {self.native_context}] (the model's context), got "
                            f"{tokens}")
        self.context_limit = tokens

    def _output_embeddings(self) -> nn.Module:
        """The model's LM head module, looked up once per model: transformers' lookup walks the model (~10 us), and
        the device is asked several times a round (the module's weight stays the place to read it from)."""
        cached = self.__dict__.get("_head_module")
        if cached is None or cached[0] is not self.model:
            cached = (self.model, self.model.get_output_embeddings())
            self.__dict__["_head_module"] = cached
        return cached[1]

    @property
    def device(self) -> torch.device:
        return self._output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._output_embeddings().weight.dtype

    @property
    def precision(self) -> str:
        """The dtype's name, or "int8" for an int8 target (bfloat16 activations)."""
        return "int8" if self.int8 else str(self.dtype).removeprefix("torch.")

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def sampling_defaults(self) -> dict:
        """The sampling settings the model's generation_config.json sets itself (temperature, top_p, top_k, min_p,
        repetition_penalty; what vLLM's `--generation-config auto` makes a request's defaults); {} where none."""
        config = getattr(self.model, "generation_config", None)
        given = config.to_diff_dict() if config is not None else {}
        return {key: given[key] for key in SAMPLING_DEFAULTS if given.get(key) is not None}

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
    @property
    def engine(self):
        """Our forward where the family is supported, else transformers'; built on first use, so a model moved or
        cast before its first forward is read as it is then."""
        if self._engine is None:
            self._engine = self._build_engine()
        return self._engine

    def _build_engine(self):
        if not self.prefer_transformers:
            try:
                engine = Transformer.from_hf(self.model, self.kernel_plan)
                self.model.register_load_state_dict_pre_hook(self._weights_loading)
                self.model.register_load_state_dict_post_hook(self._weights_loaded)
                return engine
            except Unsupported as exc:
                print(f"[dflash] {self.name}: {exc}; running through transformers", file=sys.stderr)
        return HFEngine(self.model)

    def _weights_loading(self, *args) -> None:
        """Before `model.load_state_dict(...)`: released weights are made again, since a load copies into them."""
        self.restore_plain_weights()

    def release_plain_weights(self) -> int:
        """Our forward on CPU keeps each decoder weight laid out for its kernels beside the plain one; where only
        those kernels read it, the plain copy goes (Transformer.release_plain_weights): about a third of the
        resident memory after loading a float32 target. Whatever reads it later (torch's kernels for a row count
        measured faster there, transformers' forward after `restore_plain_weights`, a move or a cast) makes it again,
        bitwise. Returns the bytes released. For processes that load and then generate (the CLI's commands)."""
        engine = self.engine
        return engine.release_plain_weights() if isinstance(engine, Transformer) and self.device.type == "cpu" else 0

    def restore_plain_weights(self) -> None:
        """The plain weights back, for transformers' own forward (the `hf` baseline) or anything else reading the
        model's parameters."""
        if isinstance(self._engine, Transformer):
            self._engine.restore_plain_weights()

    def _weights_loaded(self, module, incompatible_keys) -> None:
        """After `model.load_state_dict(...)`: our forward's fused products are copies of the weights they fuse
        (q/k/v, gate/up, their biases) and its kernels read laid-out copies of those, so they are made again from
        the weights as loaded. Without this a loaded model kept running its old weights in the C layers."""
        if isinstance(self._engine, Transformer):
            self._engine.freeze(self.kernel_plan)
            if self.int8:  # the weights as loaded, rounded as an int8 target's are
                quantize_products(self._engine)
            self._engine.lay_out(self.release_plain and self.device.type == "cpu")

    @property
    def backend(self) -> str:
        return "transformers" if isinstance(self.engine, HFEngine) else "dflash"

    def use_kernels(self, plan: KernelPlan, report: dict | None = None) -> None:
        self.kernel_plan = plan
        self.kernel_report = report or {}
        self._step_ms_now = None  # other kernels, another step time
        if isinstance(self.engine, Transformer):
            self.engine.use_plan(plan)
            self.engine.lay_out(self.release_plain and self.device.type == "cpu")

    def new_cache(self, batch: int = 1, capacity: int = 256):
        capacity = min(max(capacity, self.graph_capacity), self.max_context)  # a graph never sees its cache grow
        return self.engine.new_cache(batch=batch, capacity=capacity, max_capacity=self.max_context)

    def use_graphs(self, capacity: int = 2048, capture: bool | None = None) -> None:
        """Run decode steps and verify passes (up to 64 tokens per row) as CUDA graphs (graphs.py), with caches made
        at `capacity` positions or more so that they need not grow. `capture=False` runs the same bookkeeping
        eagerly (how the CPU tests check it)."""
        if not isinstance(self.engine, Transformer):
            raise UserError(f"{self.name} runs through transformers' forward, which dflash cannot capture as graphs")
        if capture is not False and self.device.type != "cuda":
            raise UserError("CUDA graphs need the target on a CUDA device (--device cuda)")
        self.graphs = PassGraphs(self.engine, capture)
        self.graph_capacity = capacity

    def compile_graphs(self) -> None:
        """torch.compile the passes the CUDA graphs capture (Transformer.compile_static): `--compile` on a graphed
        target. Their timings are kept apart from the plain graphs' (`measurement_key`)."""
        if self.graphs is None:
            raise UserError("compiled graphs need graphs on (use_graphs first)")
        self.engine.compile_static()
        self.graphs_compiled = True

    @contextmanager
    def weights_held(self):
        """A window (a generation, a batch run) whose passes take the weights as they were at its first pass: the
        C stack reads every weight's version at that pass only, where it read them every pass (~120 cold reads,
        0.12 ms of a 7 ms bfloat16 SmolLM2 step). A weight written in place inside the window takes effect at the
        next window; outside any window, at the next pass."""
        engine = self.engine
        if not hasattr(engine, "versions_held") or engine.versions_held is not None:
            yield  # not our forward, or a window already open: that one decides
            return
        engine.versions_held = False
        try:
            yield
        finally:
            engine.versions_held = None

    @property
    def defers_logits(self) -> bool:
        """Whether a verify pass may return its last hidden states (logits_at="hidden") and leave the LM head to
        `logits_of`, a few positions at a time: most rounds reject a draft early, and on a CPU the head's rows
        after the first rejection cost a millisecond or more for nothing. Our forward on CPU only: transformers
        computes the head inside its forward, and a CUDA graph computes every row in the pass for less than a
        second host sync would cost."""
        return (self.defer_logits and self.device.type == "cpu" and self.graphs is None
                and isinstance(self.engine, Transformer))

    def measurement_key(self, what: str) -> str:
        """Where a timing of this target (or of a drafter on it) is cached, per machine, by
        kernels.cached_measurement: model, dtype, device and kernel choice, then what was timed."""
        report = self.kernel_report or {}
        # a compiled forward or CUDA graphs time differently from the eager passes: their own entries
        compiled = "compile_s" in report or self.graphs_compiled
        mode = ("compiled:" if compiled else "") + ("graphs:" if self.graphs is not None else "")
        return f"{self.name}:{self.precision}:{self.device}:{report.get('choices')}:{mode}{what}"

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab] float32 of last hidden states that a pass with logits_at="hidden" returned."""
        return self.engine.logits(hidden, "all")

    @property
    def can_screen(self) -> bool:
        """Whether greedy tokens can skip most of the LM head (models/screening.py): deferred logits and a float32
        or bfloat16 head our kernels can screen."""
        return self.defers_logits and self.engine.can_screen

    @property
    def screens(self) -> bool:
        return bool(self.screen_greedy) and self.can_screen

    @torch.inference_mode()
    def greedy_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy token [...] of last hidden states [..., hidden]: logits_of(hidden).argmax(-1), through the
        screen where `screens` (the same tokens: see screening.py)."""
        if self.screens:
            ids = self.engine.greedy(hidden, self.screen_kind)
            if ids is not None:
                return ids
        return self.logits_of(hidden).argmax(-1)

    def forward(self, input_ids: torch.Tensor, cache=None, feature_layers: tuple[int, ...] = (),
                logits_at: str | torch.Tensor = "all", tree: torch.Tensor | None = None) -> TargetOutput:
        """Run `input_ids` [batch, seq] after what `cache` holds (a fresh sequence when None); return the logits at
        `logits_at` ("all", "last", "none" or one position per row; "hidden" where `defers_logits`: no logits,
        the last layer's outputs instead) and the chosen layers' outputs. `tree`: the parents [batch, seq] of a
        tree pass (trees.py; our forward only)."""
        if tree is not None:
            if isinstance(self.engine, HFEngine):
                raise UserError("tree verification needs our own forward (Llama, Qwen3, Gemma3 targets), not the "
                                "transformers fallback")
            if self.graphs is not None and logits_at == "all" and self.graphs.handles(input_ids, cache):
                logits, features = self.graphs.run(input_ids, cache, tuple(feature_layers), tree)
            else:
                logits, features = self.engine(input_ids, cache, tuple(feature_layers), logits_at, tree)
            if logits_at == "hidden":
                return TargetOutput(logits=None, features=features, hidden=logits)
            return TargetOutput(logits=logits, features=features)
        if logits_at == "hidden" and not self.defers_logits:
            raise ValueError("logits_at='hidden' needs a target that defers logits (see defers_logits)")
        # one look at the config a pass, not one per feature layer: transformers' config attributes go through
        # get_text_config and ~20 hasattr calls each, ~60 lookups a round of a drafter reading 5 layers
        layers = self.num_layers if feature_layers else 0
        if feature_layers and not 0 <= min(feature_layers) <= max(feature_layers) < layers:
            bad = next(i for i in feature_layers if not 0 <= i < layers)
            raise UserError(f"feature layer {bad} is out of range for a {layers}-layer target")
        if cache is None and not isinstance(self.engine, HFEngine):
            cache = self.new_cache(batch=input_ids.shape[0], capacity=input_ids.shape[1])
        if self.graphs is not None and logits_at == "all" and self.graphs.handles(input_ids, cache):
            logits, features = self.graphs.run(input_ids, cache, tuple(feature_layers))
        else:
            logits, features = self.engine(input_ids, cache, tuple(feature_layers), logits_at)
        if logits_at == "hidden":
            return TargetOutput(logits=None, features=features, hidden=logits)
        return TargetOutput(logits=logits, features=features)

    # ---- text -----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for a user prompt; wrapped in the chat template when the tokenizer has one and chat=True."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            return self.encode_messages([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None,
                        options: "TemplateOptions | None" = None) -> list[int]:
        """Token ids for chat `messages` through the chat template; `tools` (OpenAI's function tools) go to a
        template that describes them itself (tools.encode_chat); `options`: the template's own arguments."""
        options = options or TemplateOptions()
        if not getattr(self.tokenizer, "chat_template", None) and options.template is None:
            return self.encode_prompt("\n".join(m["content"] for m in messages), chat=False)
        from jinja2 import TemplateError  # what apply_chat_template renders with

        options.check(messages)
        extra = {"tools": tools} if tools else {}
        if options.template is not None:
            extra["chat_template"] = options.template
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **extra, **options.kwargs)
        except (TemplateError, ValueError) as error:  # the template's raise_exception, a message it cannot place
            raise UserError(f"the chat template refused these messages: {error}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # By default keep special tokens the target chose itself (a generated mask id is real output); stop tokens
        # are cut by the decoding loop before we get here.
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def own_storage(model: nn.Module) -> None:
    """Copy each parameter and buffer that lives in memory torch did not allocate into memory of its own.
    transformers loads a safetensors file whose dtype is the one asked for as views into the file's mapping
    (storages that are not resizable), and while one view lives every page of the file that was read stays
    resident: with SmolLM2 in float32, the embedding (113 MB) kept the whole 513 MB file resident after the decoder's
    weights had been fused into copies and released (TargetModel.release_plain_weights). Copied, the mapping closes
    with its last view."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()


def quantize_int8(target: TargetModel) -> None:
    """Makes a bfloat16 target an int8 one: every weight of its decoder layers' products rounded per output row to
    255 levels of its own scale and replaced by the bfloat16 values those stand for (FrozenLinear.quantize_int8),
    the embeddings, norms and LM head kept. Like llama.cpp's Q8_0 (which scales blocks of 32 weights), for a CPU
    whose steps are bound by the memory the weights take: our kernels read a byte a weight (native.int8_kernel: in
    pairs where the CPU has AVX512-BF16 and VBMI, widened to float32 on AVX2), elsewhere the bfloat16 values.
    Speculative decoding stays exact with respect to this model, which is not the bfloat16 one: its greedy text can
    differ from theirs (docs/RESULTS.md measures by how much). Call it before choose_kernels (as load_target does):
    the plan is measured on the int8 products."""
    if target.dtype != torch.bfloat16:
        raise ValueError("quantize_int8 needs a bfloat16 target")
    engine = target.engine
    if isinstance(engine, Transformer):
        quantize_products(engine)
    else:  # transformers' forward: the same rounding, written into its linears (no int8 kernel there)
        head = target._output_embeddings().weight
        with torch.no_grad():
            for module in target.model.modules():
                if isinstance(module, nn.Linear) and module.weight is not head and module.weight.dim() == 2:
                    module.weight.copy_(native.int8_weights(module.weight)[2])
    target.int8 = True
    # no laying out here: choose_kernels, which follows at load, lays out what its plan picks (the default plan's
    # oneDNN copies made now would be thrown away); a product laid out before is re-laid at its next use
    if target.device.type == "cpu" and native.int8_kernel() is None:
        why = native.why_not or "DFLASH_INT8=0 or DFLASH_INT8_PAIRS=0, or AVX512-BF16 without AVX512-VBMI"
        print(f"[dflash] {target.name}: int8 weights run as their bfloat16 values here ({why}): the same model, "
              "without int8's speed", file=sys.stderr)


def quantize_products(engine: Transformer) -> None:
    for layer in engine.layers:
        for product in (layer.self_attn.qkv, layer.self_attn.o_fast, layer.mlp.gate_up, layer.mlp.down_fast):
            product.quantize_int8()


def choose_kernels(target: TargetModel, kernels: str = "auto") -> None:
    """Set the target's matmul kernels: `auto` measures them on this machine (cached per machine and model),
    `packed` / `plain` / `native` force one kernel everywhere (where a weight has no native form: torch's)."""
    if kernels not in KERNEL_CHOICES:
        raise UserError(f"unknown kernels {kernels!r}; choose one of {', '.join(KERNEL_CHOICES)}")
    if kernels != "auto" or not isinstance(target.engine, Transformer) or target.device.type != "cpu":
        plan = {"plain": PLAIN, "native": NATIVE}.get(kernels, PACKED)
        report = {"kernels": kernels, "measured": False}
        engine = target.engine
        if target.device.type == "cuda" and isinstance(engine, Transformer):  # cuBLAS's matmuls; our attention calls
            report["attention"] = sdpa_backends.choose(target.device, target.dtype, engine.layers[0].self_attn.heads,
                                                       engine.kv_heads, engine.head_dim)
        target.use_kernels(plan, report)
        if isinstance(engine, Transformer) and kernels != "native":  # forced torch kernels: prompts stay in torch
            engine.prompts_in_c_up_to = 0
        return
    engine = target.engine
    model_key = f"{target.name}:{target.precision}"
    start = time.perf_counter()
    plan, measured = kernel_plan_for(model_key, engine.frozen_linears(),
                                     refine=lambda measured_plan: settle_layer_kernels(target, measured_plan),
                                     still_valid=lambda cached: plan_still_fits(target, cached))
    target.use_kernels(plan, {"kernels": "auto", "measured_now": measured, "choices": plan.summary(),
                              "measure_s": round(time.perf_counter() - start, 3)})
    choose_prompts_in_c(target)
    choose_narrow_passes(target)


def prompts_in_c_from(medians: dict[str, float]) -> int:
    """Transformer.prompts_in_c_up_to from the medians of prompts timed both ways ("c64" and "torch64", ...): none
    if the C stack lost at the shortest length (a tie keeps torch's layers); else up to where its time over torch's
    reaches 1 along the line through the last length it won at and the first it lost at; where it won at every
    length, every prompt, unless a length past PROMPT_LENGTHS was timed (`choose_prompts_in_c`'s long prompt) and
    the ratio rose to it: then up to where the line through the last two lengths reaches 1."""
    timed = sorted(int(name[1:]) for name in medians if name[0] == "c" and name[1:].isdigit()
                   and f"torch{name[1:]}" in medians)
    ratio = {n: medians[f"c{n}"] / medians[f"torch{n}"] for n in timed}
    if not timed or ratio[timed[0]] >= 1:
        return 0
    for won, n in zip(timed, timed[1:]):
        if ratio[n] >= 1:
            return crossing(won, n, ratio)
    if timed[-1] <= max(PROMPT_LENGTHS) or ratio[timed[-1]] <= ratio[timed[-2]]:
        return EVERY_PROMPT
    return min(EVERY_PROMPT, crossing(timed[-2], timed[-1], ratio))


def crossing(a: int, b: int, ratio: dict) -> int:
    """The length at which the line through (a, ratio[a]) and (b, ratio[b]) reaches a ratio of 1"""
    return round(a + (1 - ratio[a]) * (b - a) / (ratio[b] - ratio[a]))


def prompt_chunk_from(medians: dict[str, float], length: int = max(PROMPT_LENGTHS)) -> int:
    """Transformer.prompt_chunk from the medians of a prompt of `length` through the C stack in passes of each of
    PROMPT_CHUNKS ("c384@64", ...): the fastest, the shorter on a tie."""
    return min(PROMPT_CHUNKS, key=lambda chunk: (medians[f"c{length}@{chunk}"], chunk))


def choose_prompts_in_c(target: TargetModel, repeats: int = 2) -> None:
    """Whether prompts go through the C stack or torch's layers whole, up to what length, and in passes of how
    many tokens: which is faster depends on the machine (oneDNN's products over many rows against the C stack's
    fused layer and attention, Transformer._prompt_in_c; a pass reads every weight once, and on an Intel Xeon with
    AMX a bfloat16 SmolLM2 prompt of 1024 tokens took 0.81x the time in passes of 256 as of 64, int8 0.86x,
    float32 1.03x). Prompts of PROMPT_LENGTHS timed both ways, and the longest in passes of each of PROMPT_CHUNKS,
    interleaved; where the C stack won at both lengths, a LONG_PROMPT timed once each way too (its attention costs
    more a token as the context grows: prompts_in_c_from draws the line). Once per machine, model and kernel choice
    (`cached_timing`; on 2 Intel Xeon cores 6.2 s for a float32 SmolLM2, 2.2 s in bfloat16, and where the long
    prompt is timed, about 5 s and 2 s more: a warm-up and a timing each way, as torch's first run of a shape
    also makes its kernels).
    DFLASH_PROMPTS_IN_C=0 keeps every prompt in torch's layers, unmeasured."""
    from . import native

    engine = target.engine
    if not isinstance(engine, Transformer) or target.device.type != "cpu" or native.library() is None:
        return
    if os.environ.get("DFLASH_PROMPTS_IN_C", "1") == "0":
        engine.prompts_in_c_up_to = 0
        return
    ids = torch.tensor([[5 + i % 50 for i in range(LONG_PROMPT)]])

    def measure() -> dict:
        def prompt(n: int, up_to: int, chunk: int = PROMPT_CHUNKS[0]):
            def call():
                engine.prompts_in_c_up_to, engine.prompt_chunk = up_to, chunk
                target.forward(ids[:, :n], target.new_cache(capacity=n), logits_at="last")
            return call

        longest = max(PROMPT_LENGTHS)
        calls = {f"torch{n}": prompt(n, 0) for n in PROMPT_LENGTHS}
        calls.update({f"c{n}": prompt(n, EVERY_PROMPT) for n in PROMPT_LENGTHS if n < longest})
        calls.update({f"c{longest}@{chunk}": prompt(longest, EVERY_PROMPT, chunk) for chunk in PROMPT_CHUNKS})
        medians = interleaved_medians(calls, repeats)
        chunk = prompt_chunk_from(medians)
        medians[f"c{longest}"] = medians[f"c{longest}@{chunk}"]
        long = min(LONG_PROMPT, target.max_context)
        if long > longest and prompts_in_c_from(medians) == EVERY_PROMPT:  # won at both: how far does it go on?
            medians.update(interleaved_medians({f"c{long}": prompt(long, EVERY_PROMPT, chunk),
                                                f"torch{long}": prompt(long, 0)}, 1))
        return {"up_to": prompts_in_c_from(medians), "chunk": chunk,
                **{name: round(s, 5) for name, s in medians.items()}}

    choice = cached_timing(target, f"prompts-in-c-long:{native.build_id()}", measure)
    engine.prompts_in_c_up_to, engine.prompt_chunk = choice["up_to"], choice["chunk"]
    if target.kernel_report is not None:
        target.kernel_report["prompts_in_c_up_to"] = engine.prompts_in_c_up_to
        target.kernel_report["prompt_chunk"] = engine.prompt_chunk


NARROW_WIDTHS = (2, 3, 4, 5)  # the passes whose products choose_narrow_passes times


def choose_narrow_passes(target: TargetModel, repeats: int = 3) -> None:
    """How our products read the panels for passes of a few tokens (native.narrow_passes): two panels at a time up
    to 4 rows, or one panel with the next chunk requested, whichever runs passes of NARROW_WIDTHS tokens in less
    time in all, timed both ways interleaved after 64 tokens, once per machine, model and kernel build
    (`cached_timing`; ~1 s). On AMD EPYC Zen 3 and 4 two panels won; on an Intel Xeon with AVX-512 one panel took
    0.67-0.81x the time at 3-5 float32 tokens (forty-eighth session). Outputs are bitwise the same either way."""
    from . import native

    engine = target.engine
    if not isinstance(engine, Transformer) or target.device.type != "cpu" or native.library() is None:
        return
    def measure() -> dict:  # (only where no timing is cached: the 64-token prefill is not free either)
        cache = target.new_cache(capacity=96)
        target.forward(torch.full((1, 64), 5, device=target.device), cache)

        def passes(way: str):
            def call():
                native.set_narrow_passes(way)
                for width in NARROW_WIDTHS:
                    target.forward(torch.full((1, width), 7, device=target.device), cache, logits_at="all")
                    cache.truncate(64)
            return call

        medians = interleaved_medians({way: passes(way) for way in native.NARROW_PASSES}, repeats)
        return {"way": min(medians, key=medians.get), **{way: round(s, 5) for way, s in medians.items()}}

    way = cached_timing(target, f"narrow-passes:{native.build_id()}", measure)["way"]
    native.set_narrow_passes(way)
    if target.kernel_report is not None:
        target.kernel_report["narrow_passes"] = way


def plan_still_fits(target: TargetModel, plan: KernelPlan, timer=None) -> bool:
    """False when `plan` was measured on a busier machine than this one is now: its recorded 1-token pass took
    more than 1 / STALE_RATIO times what one takes now. Timings taken while another job held the cores pick
    kernels that lose on a quiet machine (seen: a plan measured during a test run chose oneDNN everywhere, 5x
    slower steps, and every later run reused it). A machine busier now than then keeps the plan: re-measuring
    under load would only repeat the mistake. About 0.1 s (three steps)."""
    recorded = plan.timings_ms.get("1-token pass")
    if not recorded:
        return True
    target.engine.use_plan(plan)
    return time_pass(target, 1, repeats=3, timer=timer) >= STALE_RATIO * min(recorded.values())


def cached_timing(target: TargetModel, what: str, measure, timer=None) -> dict:
    """`measure()`'s result for `what` on `target` (relative timings: pass costs, head savings), cached per machine
    like a kernel plan, together with the 1-token pass time of the moment it was taken. One taken on a busier
    machine than this one is now (that pass more than 1 / STALE_RATIO times today's) is measured again: timings taken
    while another job held the cores were seen to price a 2-token pass above an 8-token one, and every later run
    reused them. The pass is timed once per process (three steps, about 0.1 s)."""
    from .kernels import cached_measurement

    def step_ms() -> float:
        if target._step_ms_now is None:
            target._step_ms_now = time_pass(target, 1, repeats=3, timer=timer)
        return target._step_ms_now

    def timed() -> dict:
        result = measure()
        result["step_ms"] = round(step_ms(), 3)
        return result

    def still_valid(cached: dict) -> bool:
        return "step_ms" in cached and step_ms() >= STALE_RATIO * cached["step_ms"]

    return cached_measurement(target.measurement_key(what), timed, still_valid=still_valid)[0]


def interleaved_medians(calls: dict, repeats: int = 7) -> dict:
    """Median seconds of each of `calls` (name -> function), timed in turn `repeats` times after one warm-up round:
    interleaved, so that a slower moment of the machine weighs on every call alike."""
    times: dict = {name: [] for name in calls}
    for run in range(repeats + 1):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            if run:
                times[name].append(time.perf_counter() - started)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def time_pass(target: TargetModel, width: int, repeats: int = 5, timer=None) -> float:
    """Median milliseconds of a `width`-token pass after a 16-token context, with the engine's current plan."""
    timer = timer or time.perf_counter
    cache = target.new_cache(capacity=64)
    target.forward(torch.full((1, 16), 5, device=target.device), cache)
    ids = torch.full((1, width), 5, device=target.device)
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        start = timer()
        target.forward(ids, cache, logits_at="all")
        times.append(timer() - start)
        cache.truncate(16)
    return 1000 * sorted(times[1:])[repeats // 2]


def settle_layer_kernels(target: TargetModel, plan: KernelPlan, repeats: int = 5, timer=None) -> KernelPlan:
    """`plan`, with our kernel for every product of a 1-token step and/or of a 2-16-token pass wherever that runs
    those passes faster, timed whole.

    Timing products one by one cannot see that where all four products of a layer use our kernel, the whole layer
    runs as ONE C call for a pass of up to 16 tokens (native.layer): on SmolLM2 a step of 24 ms against 45 ms,
    while a single product often times within noise of oneDNN's, so one product chosen otherwise cost every layer
    its fast path. So a 1-token step and an 8-token pass (the 2-16 bucket's representative, as in measure_plan)
    are timed both ways, interleaved, median of `repeats` (about two seconds)."""
    engine = target.engine
    native_shapes = {(lin.out_features, lin.in_features, lin.weight.dtype)
                     for lin in engine.frozen_linears() if "native" in lin.kernels()}

    def with_native(base: KernelPlan, bucket: int) -> KernelPlan:
        revised = KernelPlan(dict(base.choices), base.default, dict(base.timings_ms))
        for shape in native_shapes:
            revised.choices[shape_key(*shape, bucket)] = "native"
        return revised

    timer = timer or time.perf_counter
    chosen = plan
    for width, bucket in ((1, 1), (8, 16)):
        fused = with_native(chosen, bucket)
        if fused.choices == chosen.choices:
            continue
        cache = target.new_cache(capacity=64)
        target.forward(torch.full((1, 16), 5, device=target.device), cache)
        ids = torch.full((1, width), 5, device=target.device)
        times: dict[str, list[float]] = {"measured": [], "fused": []}
        for _ in range(repeats + 1):  # the first round warms up (tiles and packed copies made, caches filled)
            for name, candidate in (("measured", chosen), ("fused", fused)):
                engine.use_plan(candidate)
                start = timer()
                target.forward(ids, cache, logits_at="all")
                times[name].append(timer() - start)
                cache.truncate(16)
        median = {name: round(1000 * sorted(t[1:])[repeats // 2], 3) for name, t in times.items()}
        if median["fused"] < median["measured"]:
            chosen = fused
        chosen.timings_ms[f"{width}-token pass"] = median
    engine.use_plan(chosen)
    return chosen


def compile_target(target: TargetModel, widths: tuple[int, ...] = (1, 16)) -> float:
    """torch.compile our forward and warm it up at the widths a run uses; returns the seconds that took (the
    transformers fallback is left as it is)."""
    import time

    if not isinstance(target.engine, Transformer):
        return 0.0
    start = time.perf_counter()
    target.engine.compile()
    target._step_ms_now = None
    cache = target.new_cache(capacity=64)
    target.forward(torch.full((1, 8), 5, device=target.device), cache)
    for width in widths:
        target.forward(torch.full((1, width), 5, device=target.device), cache)
        cache.truncate(8)
    seconds = time.perf_counter() - start
    target.kernel_report["compile_s"] = round(seconds, 1)
    return seconds


def load_target(spec: str = DEFAULT_TARGET, dtype: str = "float32", device: str = "cpu",
                kernels: str = "auto", release_plain: bool = False) -> TargetModel:
    """Load a target from a registry name, a local HF folder, a .gguf file, or a hub id (when online).
    `release_plain`: TargetModel.release_plain, for a process that will not run transformers' forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if dtype not in TARGET_DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(TARGET_DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked for but CUDA is not available")
    if dtype == "int8" and not device.startswith("cpu"):
        raise UserError("--dtype int8 is for CPU targets (a GPU's bfloat16 steps are not bound by the weights' bytes)")
    torch_dtype = TARGET_DTYPES[dtype]
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
        else:  # a hub id: from the hub when it answers, else from the local hub cache alone, without retries
            offline = not hub_reachable()
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype, local_files_only=offline)
            tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=offline)
    except UserError:
        raise
    except OSError as exc:
        known = ", ".join(REGISTRY)
        where = "" if spec in REGISTRY or path.exists() else (
            " (not a registry name, a model folder or a .gguf file; as a hub id it needs the network or the hub "
            "cache)")
        close = close_registry_names(spec)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; registry names: {known}"
        raise UserError(f"could not load target {spec!r}{where}: {exc.__class__.__name__}{hint}") from exc
    return wrap_target(model.to(device), tokenizer, spec, kernels, release_plain, int8=dtype == "int8")


def wrap_target(model: nn.Module, tokenizer, name: str = "target", kernels: str = "auto",
                release_plain: bool = False, int8: bool = False) -> TargetModel:
    """A target of a causal LM already loaded (a transformers model and its tokenizer, on its device and in its
    dtype): our forward where its family has one, with the kernels `kernels` says (auto: timed on this machine),
    transformers' otherwise. Its weights stay shared with `model`, which keeps working as before. `int8`: its
    decoder layers' weights quantized (CPU)."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise UserError(f"wrap_target takes a transformers causal LM, got {type(model).__name__}")
    if model.device.type == "cpu":
        own_storage(model)
    target = TargetModel(model=model, tokenizer=tokenizer, name=name, release_plain=release_plain)
    if int8:
        quantize_int8(target)
    choose_kernels(target, kernels)
    return target
