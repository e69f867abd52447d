"""Our own forward of the target (Llama, Qwen2, Qwen3, Gemma3 text models), gpt-fast style.

Built from a loaded Hugging Face model and sharing its weight storage (the fused q/k/v and gate/up weights become
the storage the HF modules view), it replaces the per-call work of the transformers forward: no DynamicCache objects
rebuilt and cropped each round (a position-indexed `KVCache` where rollback sets a length), no hooks (the feature
layers' outputs are kept inline), one fused product for q/k/v and one for gate/up, the matmul kernel measured fastest
for each shape (kernels.py). The HF model stays untouched and serves as the oracle in tests and as `hf` in bench.

Any other architecture, or a RoPE whose frequencies depend on the sequence length, raises `Unsupported`; the
target adapter then falls back to transformers (models/hf.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import trees
from .cache import KVCache, scatter_index
from . import memory, native, sdpa_backends
from .kernels import FrozenLinear, KernelPlan, products_generation, row_bucket
from .layers import Attention, GatedMLP, RMSNorm, Rotary, causal_mask, native_constants
from .screening import ScreenedHead

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text")
MAX_NATIVE_TOKENS = 16  # the most new tokens per row a pass may have to run its layers in C (decode steps, verify
# passes, batches of them, whatever the rows): their products use the kernels chosen for the verify row bucket
# (kernels.py). Every row's tokens then go through the same chains as a step of that row alone, so a batched round
# commits the tokens a sequence alone would: through torch's kernels, a batch of 4 rows verifying 4 drafts each
# (20 tokens) rounded bfloat16 sums differently and changed 3 of 4 GSM8K outputs. Longer rows are prefills, but
MAX_VERIFY_TOKENS = trees.MAX_TREE_TOKENS  # ... after a cached prefix, rows of up to 64 run in C too: verify
# passes of blocks over 16 (--block-size 32), which through torch's layers changed 3 of 3 bfloat16 GSM8K outputs of
# ngram@32:whole.
EVERY_PROMPT = 1 << 30  # Transformer.prompts_in_c_up_to where prompts of any length run through the C stack
PROMPT_CHUNKS = (MAX_VERIFY_TOKENS, 256)  # the tokens a prompt's pass through the C stack may take at most
# (Transformer.prompt_chunk): each pass reads every weight once, so longer passes read them fewer times, but hold
# scores for every token (SCORES_BUDGET); which is faster is measured per machine (target.choose_prompts_in_c:
# passes of 128 timed between the two on an Intel Xeon, so they are not timed; a long context halves 256 to them)
SCORES_BUDGET = 64 << 20  # bytes of attention scores (tokens x heads x positions, float32) a longer pass may hold


def runs_in_c(n: int, starts: list[int]) -> bool:
    """Whether a causal pass of n new tokens a row, after each row's `starts` cached ones, runs its layers in C."""
    return n <= MAX_NATIVE_TOKENS or n <= MAX_VERIFY_TOKENS and min(starts) > 0


class Unsupported(Exception):
    """This model cannot run through our forward; use the transformers fallback."""


def static_layer(layer: "DecoderLayer", h: torch.Tensor, rope, layer_keys: torch.Tensor, layer_values: torch.Tensor,
                 at: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
    """One layer of a graphed pass (Transformer.forward_static): the new keys/values scattered at `at` into the
    layer's whole buffers, which attention reads. A function of its tensors and the layer alone, so that one
    torch.compile of it serves every layer (Transformer.compile_static)."""
    def store(k, v):
        layer_keys[at] = k
        layer_values[at] = v
        return layer_keys, layer_values

    return layer.torch_forward(h, rope, store, mask)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; Gemma's variant also normalises each block's output ("sandwich")."""

    def __init__(self, attention: Attention, mlp: GatedMLP, norms: dict[str, RMSNorm], window: int | None,
                 layer_type: str, softcap: float | None):
        super().__init__()
        self.self_attn, self.mlp = attention, mlp
        self.input_layernorm = norms["input_layernorm"]
        self.post_attention_layernorm = norms["post_attention_layernorm"]
        self.sandwich = "pre_feedforward_layernorm" in norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norms["pre_feedforward_layernorm"]
            self.post_feedforward_layernorm = norms["post_feedforward_layernorm"]
        self.window, self.layer_type, self.softcap = window, layer_type, softcap
        self.rope_index = 0  # which of the model's RoPE tables (by layer type) it reads: set by Transformer

    def forward(self, h: torch.Tensor, rope, cache: KVCache, index: int, mask: torch.Tensor | None,
                starts: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """`starts`: each row's cache length before this pass (int64 [b], cache.lengths by default). `causal`:
        False for a tree pass, whose mask only torch applies layer by layer (the C stack takes it whole)."""
        if causal and runs_in_c(h.shape[1], cache.lengths):  # steps and verify passes, batched or not: one C call
            out = self.native_step(h, rope, cache, index, starts)
            if out is not None:
                return out
        return self.torch_forward(h, rope, lambda k, v: cache.write(index, k, v), mask)

    def torch_forward(self, h: torch.Tensor, rope, store_kv, mask: torch.Tensor | None) -> torch.Tensor:
        """The layer in torch ops. `store_kv(k, v)` keeps the new tokens' keys/values [b, KV, n, d] and returns the
        keys/values to attend to: the cache up to the longest row (forward) or its whole buffers (forward_static)."""
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(h), rope)
        keys, values = store_kv(k, v)
        out = attn.output(attn.attend(q, keys, values, mask, self.softcap))
        if self.sandwich:
            h = h + self.post_attention_layernorm(out)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + out
        return h + self.mlp(self.post_attention_layernorm(h))

    def native_step(self, h: torch.Tensor, rope, cache: KVCache, index: int,
                    starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """This layer over the new tokens of each row through native.layer, or None where it cannot run there
        (soft-capped attention, biased MLPs, kernels the plan did not pick for this many rows, mixed dtypes, another
        device). The mask the caller built is causal by position in each row (within a sliding window where the
        layer has one), which the C layer applies itself."""
        rows, tokens = h.shape[0], h.shape[1]
        constants = self._native_constants(h.dtype, min(rows * tokens, MAX_NATIVE_TOKENS))
        keys, values = cache.keys[index], cache.values[index]
        cos, sin = rope
        if (constants is None or h.device.type != "cpu" or not (keys.is_contiguous() and h.is_contiguous())
                or cos.dtype != h.dtype or not (cos.is_contiguous() and sin.is_contiguous())
                or cos.shape[0] != rows):
            return None
        if starts is None or starts.dtype != torch.int64 or starts.device.type != "cpu":
            starts = torch.tensor(cache.lengths, dtype=torch.int64)
        return native.layer(h, constants, rope, keys, values, starts)

    def _native_constants(self, dtype: torch.dtype, tokens: int) -> tuple | None:
        """The layer's constant arguments for native.layer (layers.native_constants); None for what C does not
        run: soft-capped attention (Gemma2). Gemma3's sandwich: its pre-MLP norm is C's norm2, the norms after
        attention and after the MLP C's norms 3 and 4."""
        if self.softcap is not None:
            return None
        modules = self._modules  # per call: plain dict lookups, not nn.Module.__getattr__
        if self.sandwich:
            return native_constants(self, modules["self_attn"], modules["mlp"], modules["input_layernorm"],
                                    modules["pre_feedforward_layernorm"], dtype, tokens,
                                    (modules["post_attention_layernorm"], modules["post_feedforward_layernorm"]),
                                    self.window, self.rope_index)
        return native_constants(self, modules["self_attn"], modules["mlp"], modules["input_layernorm"],
                                modules["post_attention_layernorm"], dtype, tokens, None, self.window,
                                self.rope_index)


class ProductsUnchanged:
    """Whether the layers' products still hold the weights, and still use the kernels, they held when made: a
    check of the C stack's arguments once per pass. Asking each layer (`native_constants`: every product's
    signature and plan) cost ~0.65 ms a bfloat16 step of ~10 on SmolLM2; this compares each weight buffer's
    identity (a move or a cast replaces it), its version (an in-place write bumps it; inference tensors have none
    and cannot be written outside inference mode) and its plan's per-bucket choices: ~19 us with its objects in
    the caches, but ~190 us in a pass, after the stack has streamed the weights through them (SmolLM2, 120
    products). So the identities and plans are compared only when kernels.products_generation has moved (a new
    plan, product or weight buffer somewhere), and the versions every pass (~130 us of those 190)."""

    PRODUCTS = (("self_attn", "qkv"), ("self_attn", "o_fast"), ("mlp", "gate_up"), ("mlp", "down_fast"))

    def __init__(self, layers):
        self.generation = products_generation()
        self.state = []
        for layer in layers:
            for block, name in self.PRODUCTS:
                modules = layer._modules[block]._modules  # the product itself may be replaced (a new freeze)
                lin = modules[name]
                weight = lin._buffers["weight"]
                version = None if weight.is_inference() else weight._version
                self.state.append((modules, name, lin, lin._buffers, weight, version, lin._kernel_by_bucket))
        self.versions = [(weight, version) for *_, weight, version, _ in self.state if version is not None]

    def holds(self, versions: bool = True) -> bool:
        """`versions` False: the weights' versions are taken as read (TargetModel.weights_held)."""
        if products_generation() != self.generation:
            for modules, name, lin, buffers, weight, _, kernels in self.state:
                if modules[name] is not lin or buffers["weight"] is not weight or lin._kernel_by_bucket is not kernels:
                    return False
            self.generation = products_generation()  # some other product moved: these stand
        for weight, version in self.versions if versions else ():
            if weight._version != version:
                return False
        return True


class Transformer(nn.Module):
    """forward(input_ids, cache, feature_layers) -> (logits, features), over a KVCache of its own shape."""

    def __init__(self, config, embed_weight: torch.Tensor, embed_scale: float | None, layers: list[DecoderLayer],
                 norm: RMSNorm, lm_head: nn.Linear, rotary: dict[str, Rotary], final_softcap: float | None):
        super().__init__()
        self.config = config
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.embed_scale = embed_scale
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = nn.ModuleDict(rotary)
        for layer in layers:  # the C stack reads each layer's RoPE table by its index among the rotary's
            layer.rope_index = list(rotary).index(layer.layer_type)
        self.final_softcap = final_softcap
        self.kv_heads = layers[0].self_attn.kv_heads
        self.head_dim = layers[0].self_attn.head_dim
        # the C stack's check of the weights' versions (ProductsUnchanged): None every pass; False at the next pass
        # only, then True: not until the window ends (TargetModel.weights_held)
        self.versions_held: bool | None = None
        # prompts (a row's pass from an empty cache, or of over 64 new tokens) of up to this many tokens run through
        # the C stack, up to prompt_chunk tokens a pass: both measured per machine at load
        # (target.choose_prompts_in_c); 0: torch's layers. Unmeasured (test targets): all of them, 64 a pass, so
        # every engine test reads its prompts in C
        self.prompts_in_c_up_to = EVERY_PROMPT
        self.prompt_chunk = MAX_VERIFY_TOKENS
        self.heads = layers[0].self_attn.heads

    # ---- building ------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, model: nn.Module, plan: KernelPlan | None = None) -> "Transformer":
        config = model.config.get_text_config()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise Unsupported(f"model type {config.model_type!r} (ours: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if getattr(config, "attn_implementation", None) == "flash_attention_2":
            raise Unsupported("flash attention models keep transformers' forward")
        decoder = model.get_decoder()
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        try:
            rotary = {t: Rotary.for_config(config, head_dim, t) for t in dict.fromkeys(layer_types)}
        except NotImplementedError as exc:
            raise Unsupported(str(exc)) from exc
        gemma = config.model_type.startswith("gemma")
        softcap = getattr(config, "attn_logit_softcapping", None)
        layers = [_layer_from_hf(hf_layer, config, head_dim, layer_types[i], gemma, softcap)
                  for i, hf_layer in enumerate(decoder.layers)]
        norm = _norm_from_hf(decoder.norm, config, gemma)
        embed = decoder.embed_tokens
        embed_scale = float(getattr(embed, "scalar_embed_scale", 1.0)) if gemma else None
        engine = cls(config, embed.weight, embed_scale, layers, norm, model.get_output_embeddings(), rotary,
                     getattr(config, "final_logit_softcapping", None))
        engine.rotary.to(embed.weight.device)  # else each pass copies the frequencies over (a CUDA graph cannot)
        engine.freeze(plan)
        return engine.eval()

    def freeze(self, plan: KernelPlan | None) -> None:
        """Fused products through `plan`'s kernels (call again with a newly measured plan)."""
        self.restore_plain_weights()  # fusing reads the model's linears
        for layer in self.layers:
            layer.self_attn.freeze(plan)
            layer.mlp.freeze(plan)
        head = self.lm_head if isinstance(self.lm_head, nn.Linear) else None
        self.head = FrozenLinear.of(head, plan) if head is not None else FrozenLinear(self.lm_head.weight, None, plan)

    def release_plain_weights(self) -> int:
        """Release the plain weights of the decoder layers' products that run our kernels alone
        (FrozenLinear.release_plain): after loading, a CPU target holds each weight twice, plain (transformers'
        modules and torch's kernels read it) and laid out for ours. Returns the bytes released. The LM head keeps
        its own: the embedding may share it, and the screens are made from it."""
        released = sum(lin.release_plain() for layer in self.layers for lin in self._products(layer))
        self.__dict__.pop("_stack_args", None)  # its check of the products holds the weights it saw
        return released

    def restore_plain_weights(self) -> None:
        for lin in self.frozen_linears():
            lin.restore_plain()

    def lay_out(self, release_plain: bool = False) -> None:
        """Make every product's laid-out copies now (FrozenLinear.lay_out). `release_plain`: release each decoder
        product's plain weight as soon as its copy is made, so that loading holds one weight twice at a time, not
        all of them (SmolLM2 in float32: 538 MB more at the peak)."""
        products = {id(lin) for layer in self.layers for lin in self._products(layer)} if release_plain else set()
        released = 0
        for linear in self.frozen_linears():
            linear.lay_out()
            if id(linear) in products and linear.release_plain():
                released += 1
                if released % 8 == 0:  # the freed weights sit in the C heap until trimmed (~5 ms a trim here)
                    memory.return_freed_heap()
        self.__dict__.pop("_stack_args", None)  # its check of the products holds the weights it saw

    @staticmethod
    def _products(layer: DecoderLayer) -> list[FrozenLinear]:
        attention, mlp = layer.self_attn, layer.mlp
        return [lin for lin in (attention.qkv, attention.o_fast, mlp.gate_up, mlp.down_fast) if lin is not None]

    def compile_static(self) -> None:
        """torch.compile the graphed pass's layers (`forward_static`, as CUDA graphs run it): inductor fuses the ops
        between the products (norms, RoPE, residual adds, the gated activation, the cache writes) into a few
        kernels, which the graphs then capture. Shapes are static (a graph's width and the cache's capacity), so a
        graph width compiles once and every layer reuses it (the layer's weights are its inputs). Compiled at each
        width's first capture: seconds to a minute each, once per process."""
        import torch._dynamo

        from .graphs import MAX_GRAPHS

        # a graph per width (7) and padded row count (up to 8): past dynamo's default of 8 compiles of one function
        # the rest would run uncompiled
        limit = MAX_GRAPHS + 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        self._compiled_static_layer = torch.compile(static_layer, dynamic=False)

    def compile(self) -> None:
        """torch.compile every decoder layer (inductor on CPU; dynamic shapes, since cache lengths grow). It fuses the
        small ops between the matmuls; whether that pays is measured (`dflash generate --compile --json` reports
        the compile time and scripts/profile_round.py the step), so it is off unless asked for."""
        for layer in self.layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)

    def use_plan(self, plan: KernelPlan) -> None:
        for linear in self.frozen_linears():
            linear.use_plan(plan)

    def frozen_linears(self) -> list[FrozenLinear]:
        return [m for m in self.modules() if isinstance(m, FrozenLinear)]

    def new_cache(self, batch: int = 1, capacity: int = 256, max_capacity: int | None = None) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, self.embed_weight.dtype,
                       self.embed_weight.device, batch, capacity, max_capacity)

    # ---- running -------------------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed_weight)
        if self.embed_scale is not None:  # Gemma scales in the weight dtype (sqrt(640) -> bf16 rounds it)
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache, feature_layers: tuple[int, ...] = (),
                logits_at: str | torch.Tensor = "all", tree: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run `input_ids` [b, n], row r at positions cache.lengths[r] onward, and advance every row by n.

        Returns (logits [b, m, vocab] float32, features [b, n, len(feature_layers) * hidden]): the feature of layer
        i is the OUTPUT of decoder layer i. logits_at: "all" (m = n), "last" (m = 1), "none" (no logits), a
        LongTensor [b] of one position per row (m = 1; e.g. each row's last real token in a padded prefill), or
        "hidden": the last layer's outputs [b, n, hidden] in place of logits, for `logits` to finish later.

        `tree`: int64 [b, n] parents of a tree pass (trees.py): token i of row r goes into cache slot lengths[r] + i
        as before, but sits at the position of its depth and attends to the cached positions and its ancestors."""
        b, n = input_ids.shape
        starts = cache.lengths
        prompt_in_c = tree is None and not runs_in_c(n, starts) and self._prompt_in_c(input_ids)
        if prompt_in_c and n > self._chunk_at(starts[0]):
            return self._prompt_in_chunks(input_ids, cache, feature_layers, logits_at)
        end = max(starts) + n
        cache.reserve(end)
        device = input_ids.device

        def positions_of() -> tuple[torch.Tensor, torch.Tensor]:
            """(the rows' starts, every token's position) as tensors. Made only where a pass needs them: a one-row
            pass through the C stack does not, and after the stack has streamed the weights each small torch op
            ran cold, ~30 us (the two took 0.14 ms of a 7 ms bfloat16 SmolLM2 step on 2 AMD EPYC Zen 4 cores)."""
            start_tensor = torch.tensor(starts, device=device)
            if tree is None:
                return start_tensor, start_tensor[:, None] + torch.arange(n, device=device)
            return start_tensor, start_tensor[:, None] + torch.tensor([trees.depths(row) for row in tree.tolist()],
                                                                      device=device)

        start_tensor, positions = positions_of() if b > 1 or tree is not None else (None, None)
        h = self.embed(input_ids)
        ropes = {t: rotary.spans(starts, n, positions, h.dtype, in_order=tree is None, device=device)
                 for t, rotary in self.rotary.items()}
        if any(not 0 <= i < len(self.layers) for i in feature_layers):
            raise ValueError(f"feature layers {feature_layers} out of range for a {len(self.layers)}-layer target")
        in_c = None
        # a tree pass of up to 64 nodes runs in C too (with the verify bucket's kernels, as a batch does): through
        # torch's layers a 32-node float32 SmolLM2 pass took 60 ms, in C 41 (2 Zen 4 cores)
        if tree is None and (prompt_in_c or runs_in_c(n, starts)) or tree is not None and self._tree_in_c(n, end):
            bits = None if tree is None else trees.as_int64([trees.visibility(row) for row in tree.tolist()])
            in_c = self._native_stack(h, ropes, cache, starts, feature_layers, bits)
        if in_c is not None:
            h, features = in_c
        else:
            if positions is None:
                start_tensor, positions = positions_of()
            windows = {layer.layer_type: layer.window for layer in self.layers}  # one mask per layer type
            if tree is None:
                masks = {kind: self._mask(positions, starts, n, end, window) for kind, window in windows.items()}
            else:
                visible = trees.ancestors(tree.tolist(), n).to(input_ids.device)
                masks = {kind: trees.tree_mask(positions, start_tensor, visible, end, window)
                         for kind, window in windows.items()}
            outputs: dict[int, torch.Tensor] = {}
            for index, layer in enumerate(self.layers):
                h = layer(h, ropes[layer.layer_type], cache, index, masks[layer.layer_type], start_tensor,
                          causal=tree is None)
                if index in feature_layers:
                    outputs[index] = h
            features = torch.cat([outputs[i] for i in feature_layers], dim=-1) if feature_layers else None
        cache.advance(n)
        return (h if isinstance(logits_at, str) and logits_at == "hidden" else self.logits(h, logits_at)), features

    def _prompt_in_c(self, input_ids: torch.Tensor) -> bool:
        """Whether a pass that runs_in_c leaves to torch (a prompt) goes through the C stack instead, by the
        measured choice: one row on the CPU, up to prompts_in_c_up_to tokens. Why: on 2 Zen 4 cores a 48-800
        token prompt took 0.75-0.86x the time in float32 and 0.62-0.95x in bfloat16 (the C stack fuses what
        torch runs as ~10 elementwise ops a layer, and its attention reads the cache in pairs), the longer the
        closer in bfloat16, where oneDNN's products over many rows beat the verify bucket's kernels; another CPU
        may decide otherwise (docs/RESULTS.md, thirty-fifth session)."""
        return (input_ids.shape[0] == 1 and input_ids.shape[1] <= self.prompts_in_c_up_to
                and input_ids.device.type == "cpu" and native.library() is not None)

    def _prompt_in_chunks(self, input_ids: torch.Tensor, cache: KVCache, feature_layers: tuple[int, ...],
                          logits_at: str | torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A long prompt as passes of up to prompt_chunk tokens, each through the C stack (forward's result)."""
        n, start = input_ids.shape[1], cache.lengths[0]
        hidden, features = [], []
        first = 0
        while first < n:
            chunk = self._chunk_at(start + first)
            h, f = self.forward(input_ids[:, first:first + chunk], cache, feature_layers, "hidden")
            first += chunk
            hidden.append(h)
            if f is not None:
                features.append(f)
        h = torch.cat(hidden, dim=1) if len(hidden) > 1 else hidden[0]
        features = torch.cat(features, dim=1) if features else None
        return (h if isinstance(logits_at, str) and logits_at == "hidden" else self.logits(h, logits_at)), features

    def _chunk_at(self, start: int) -> int:
        """The tokens of a prompt's next pass after `start` cached ones: prompt_chunk, halved while its attention
        scores would pass SCORES_BUDGET (a long context), never under 64. Each token takes the chains of a step
        whatever the pass, so the choice changes only the time."""
        chunk = self.prompt_chunk
        while chunk > MAX_VERIFY_TOKENS and chunk * self.heads * (start + chunk) * 4 > SCORES_BUDGET:
            chunk //= 2
        return max(chunk, MAX_VERIFY_TOKENS)

    @torch.inference_mode()
    def forward_static(self, input_ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, feature_layers: tuple[int, ...] = (), slots: torch.Tensor | None = None,
                       starts: torch.Tensor | None = None, visible: torch.Tensor | None = None):
        """The pass as a fixed sequence of device ops over fixed buffers, as a CUDA graph needs (graphs.py): token
        r, i sits at positions[r, i] (a device tensor, not the cache's Python lengths); its keys and values are
        scattered there into `keys`/`values` (a KVCache's whole buffers [layers, b, KV, capacity, d]), and attention
        runs over the whole capacity, masked by position. Returns (logits [b, n, vocab] float32, features) like
        `forward`; the caller moves the cache's lengths.

        A tree pass (trees.py) also gives `slots` [b, n] (where each token's keys/values go: starts + 0..n-1, while
        `positions` are its depth's), `starts` [b] and `visible` [b, n, n] (the nodes each node attends to)."""
        b, n = input_ids.shape
        h = self.embed(input_ids)
        ropes = {t: rotary(positions, h.dtype) for t, rotary in self.rotary.items()}
        capacity = keys.shape[3]
        windows = {layer.layer_type: layer.window for layer in self.layers}
        if visible is None:
            masks = {kind: causal_mask(positions, capacity, window) for kind, window in windows.items()}
        else:
            masks = {kind: trees.tree_mask(positions, starts, visible, capacity, window)
                     for kind, window in windows.items()}
        at = scatter_index(positions if slots is None else slots, self.kv_heads)
        run_layer = self.__dict__.get("_compiled_static_layer") or static_layer
        outputs: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            h = run_layer(layer, h, ropes[layer.layer_type], keys[index], values[index], at, masks[layer.layer_type])
            if index in feature_layers:
                outputs[index] = h
        features = torch.cat([outputs[i] for i in feature_layers], dim=-1) if feature_layers else None
        return self.logits(h, "all"), features

    def _tree_in_c(self, n: int, end: int) -> bool:
        """Whether the C stack can run a tree pass: one visibility word a token (a sliding window counts from each
        node's own depth there)."""
        return n <= trees.MAX_TREE_TOKENS

    def _native_stack(self, h: torch.Tensor, ropes: dict, cache: KVCache, starts: list[int],
                      feature_layers: tuple[int, ...], tree: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Every layer in ONE C call (native.stack) where every layer can run in C (see DecoderLayer.native_step),
        each reading its layer type's RoPE: (the last layer's output, the feature layers' outputs side by side, or
        None for none); else None (the
        caller then goes layer by layer, each in C where it can)."""
        keys, values = cache.keys, cache.values
        if (h.device.type != "cpu" or not h.is_contiguous()
                or not (keys[0].is_contiguous() and values[0].is_contiguous()) or keys.stride() != values.stride()):
            return None
        tables = [ropes[kind] for kind in self.rotary]  # in the order of the layers' rope_index
        if any(cos.dtype != h.dtype or not (cos.is_contiguous() and sin.is_contiguous()) for cos, sin in tables):
            return None
        tokens = min(h.shape[0] * h.shape[1], MAX_NATIVE_TOKENS)  # the verify bucket's kernels for any batch
        state = (h.dtype, row_bucket(tokens), native._pairs, native._int8_on)
        cached = self.__dict__.get("_stack_args")
        if cached is None or cached[0] != state or not cached[1].holds(versions=self.versions_held is not True):
            constants = [layer._native_constants(h.dtype, tokens) for layer in self.layers]
            if any(c is None for c in constants):
                return None
            cached = (state, ProductsUnchanged(self.layers), native.stack_args(constants), constants)
            self.__dict__["_stack_args"] = cached
        if self.versions_held is False:  # checked once for this window (TargetModel.weights_held)
            self.versions_held = True
        return native.stack(h, cached[2], tables, keys, values, starts, feature_layers, tree)

    def logits(self, h: torch.Tensor, logits_at: str | torch.Tensor) -> torch.Tensor | None:
        if isinstance(logits_at, torch.Tensor):
            h = h[torch.arange(h.shape[0], device=h.device), logits_at][:, None]
        elif logits_at == "last":
            h = h[:, -1:]
        elif logits_at == "none":
            return None
        logits = self.head.float_out(self.norm.rows(h))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @property
    def can_screen(self) -> bool:
        """Whether greedy tokens may come through a screen of the head (screening.py): a float32 or bfloat16 head on
        a CPU with our kernels, no bias, and no final softcap (tanh can round distinct logits to one value). Asked
        every round: the answer is kept for the head's current storage and dtype."""
        head = self.lm_head
        weight, bias = head.weight, getattr(head, "bias", None)
        key = (weight.data_ptr(), weight.dtype, weight.device, bias is None, self.final_softcap)
        cached = self.__dict__.get("_can_screen")
        if cached is None or cached[0] != key:
            cached = (key, self.final_softcap is None and ScreenedHead.applies(weight, bias))
            self.__dict__["_can_screen"] = cached
        return cached[1]

    def screen(self, kind: str) -> ScreenedHead | None:
        """The head's screen of `kind` (made on first use, kept), or None where none applies. Kept per head storage,
        version and dtype and per layout of bfloat16 weights, which decides how a bfloat16 head's own kernel sums
        (and so how the screen must sum its survivors): a moved, cast, rewritten (`load_state_dict`) or re-laid head
        gets a new screen, whose rounded copy of the head is made from the weights as they are."""
        weight = self.lm_head.weight
        version = 0 if weight.is_inference() else weight._version
        key = (kind, weight.data_ptr(), version, weight.dtype, native._pairs, native._int8_vnni, native._screen_wide)
        screens = self.__dict__.setdefault("_screens", {})
        if key not in screens:
            for stale in [k for k in screens if k[0] == kind]:
                del screens[stale]
            screens[key] = ScreenedHead(weight, kind) if self.can_screen else None
            if screens[key] is not None and "_wide_from" in self.__dict__:
                screens[key].wide_from = self.__dict__["_wide_from"]
        return screens[key]

    def set_wide_from(self, rows: int) -> None:
        """From how many rows integer screens round their inputs wide (screening.ScreenedHead.wide_from): this head's
        screens now and those made later (timings.measured_wide_from measures it)."""
        self.__dict__["_wide_from"] = rows
        for screen in self.__dict__.get("_screens", {}).values():
            if screen is not None:
                screen.wide_from = rows

    def keep_screen(self, kind: str | None) -> None:
        """Drop every screen but `kind`'s (each is a copy of the head: 28-56 MB for SmolLM2)."""
        screens = self.__dict__.get("_screens", {})
        for other in [k for k in screens if k[0] != kind]:
            del screens[other]

    def greedy(self, h: torch.Tensor, kind: str = "bfloat16") -> torch.Tensor | None:
        """argmax over the vocabulary of the logits of last hidden states h [..., hidden] (what `logits(h, "all")`
        gives, bitwise where the head runs our kernel), found through the screen of `kind`; None where there is
        none or it cannot decide."""
        screen = self.screen(kind)
        return None if screen is None else screen.argmax(h, self.norm)

    @staticmethod
    def _mask(positions: torch.Tensor, starts: list[int], n: int, end: int, window: int | None):
        """None where every key up to `end` is visible to every query (one new token per row, rows aligned, no
        window reached): then attention needs no mask at all. CAUSAL where every row starts empty and no window
        is reached (a fresh prefill): SDPA's causal kernel then skips the masked half."""
        aligned = all(s == starts[0] for s in starts)
        if n == 1 and aligned and (window is None or end <= window):
            return None
        if end == n and (window is None or end <= window):
            return sdpa_backends.CAUSAL
        return causal_mask(positions, end, window)


# ---- reading the Hugging Face modules ------------------------------------------------------------------------------
def _norm_from_hf(hf_norm: nn.Module, config, gemma: bool) -> RMSNorm:
    norm = RMSNorm(hf_norm.weight.shape[0], _eps(hf_norm, config), unit_offset=gemma)
    norm.weight = hf_norm.weight  # shared, not copied
    return norm


def _eps(hf_norm: nn.Module, config) -> float:
    return float(getattr(hf_norm, "variance_epsilon", getattr(hf_norm, "eps", config.rms_norm_eps)))


def _share_linears(ours: nn.Module, theirs: nn.Module, names: tuple[str, ...]) -> None:
    """Our attention or MLP runs the model's own linears (the same modules, not copies sharing their weights): fusing
    them (FrozenLinear.fused) makes their weights views of the fused weight, and the model must hold those very
    parameters, so that an in-place write or a load into them reaches our products."""
    for name in names:
        setattr(ours, name, getattr(theirs, name))


def _blocks_for(hf_attn: nn.Module, hf_mlp: nn.Module, config, head_dim: int, qk_norm: bool,
                gemma: bool) -> tuple[Attention, GatedMLP]:
    """Our attention and MLP blocks shaped as the model's layer's."""
    attention = Attention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim, config.hidden_size,
        qk_norm=qk_norm, eps=_eps(hf_attn.q_norm, config) if qk_norm else config.rms_norm_eps,
        bias=hf_attn.q_proj.bias is not None, out_bias=hf_attn.o_proj.bias is not None, norm_unit_offset=gemma,
        scale=float(getattr(hf_attn, "scaling", head_dim**-0.5)),
    )
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    mlp = GatedMLP(config.hidden_size, hf_mlp.gate_proj.out_features, activation, bias=hf_mlp.gate_proj.bias is not None)
    return attention, mlp


def _layer_from_hf(hf_layer: nn.Module, config, head_dim: int, layer_type: str, gemma: bool,
                   softcap: float | None) -> DecoderLayer:
    hf_attn, hf_mlp = hf_layer.self_attn, hf_layer.mlp
    qk_norm = getattr(hf_attn, "q_norm", None) is not None
    with torch.device("meta"):  # no weights of their own: they run the model's (below); random ones took 0.8 s
        attention, mlp = _blocks_for(hf_attn, hf_mlp, config, head_dim, qk_norm, gemma)
    _share_linears(attention, hf_attn, ("q_proj", "k_proj", "v_proj", "o_proj"))
    if qk_norm:
        attention.q_norm.weight, attention.k_norm.weight = hf_attn.q_norm.weight, hf_attn.k_norm.weight
    _share_linears(mlp, hf_mlp, ("gate_proj", "up_proj", "down_proj"))
    names = ["input_layernorm", "post_attention_layernorm"]
    if gemma:
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    norms = {name: _norm_from_hf(getattr(hf_layer, name), config, gemma) for name in names}
    window = getattr(config, "sliding_window", None) if layer_type == "sliding_attention" else None
    return DecoderLayer(attention, mlp, norms, window, layer_type, softcap)
