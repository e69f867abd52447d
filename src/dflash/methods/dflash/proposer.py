"""DFlash drafting: one drafter pass proposes block_size - 1 tokens, with the drafter's confidence in each."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ...checkpoint import folder_not_found
from ...errors import UserError
from ...trees import MAX_TREE_TOKENS, best_first
from ...models.graphs import WIDTHS
from ...models.kernels import FrozenLinear, KernelPlan, covering
from ..base import (Draft, DraftPrecision, FeatureBacklog, MethodOptions, Proposer, best_drafting_seconds,
                    in_draft_dtype, shipped_drafter, with_kernel)
from .drafter import DFlashConfig, DFlashDrafter, default_mask_token_id
from .graphs import DrafterGraphs


# Draft positions read before asking the controller whether it could verify a further one (None: always read the
# whole block at once). The LM head over the draft vocabulary costs more the more positions it reads (int8 at one
# thread: 0.8 ms for 4, 2.5 ms for 15, of a 10.5 ms drafting pass), and adaptive rounds mostly verify a few drafts.
# A second read costs its own fixed part (float32: 3.1 ms for 4, 6.2 ms for 15), so whether stepping pays is
# measured: `StepwiseReading`.
FIRST_READ: int | None = 4
TREE_TOP_K = 8  # candidates per block position a tree may branch into (scripts/tree_estimate.py: 15x8 > 15x4)
READ_SMOOTHING = 0.1  # EMA weight of a row's "needed drafts past FIRST_READ"


class StepwiseReading:
    """Whether reading a block's drafts in two steps pays, shared by an engine's copies of one proposer. It does
    while the share of rows that need the second step stays under `break_even`: (head(all) - head(first)) /
    head(rest), from the head's times measured on this machine."""

    def __init__(self, break_even: float = 1.0):
        self.break_even = break_even
        self.beyond = 0.0  # EMA of how often a row's controller wanted drafts past FIRST_READ

    def pays(self) -> bool:
        return self.beyond < self.break_even

    def observe(self, needed_more: bool) -> None:
        self.beyond += READ_SMOOTHING * (float(needed_more) - self.beyond)


class DFlashProposer(FeatureBacklog, Proposer):
    name = "dflash"
    one_pass = True

    def __init__(self, drafter: DFlashDrafter, target, block_size: int | None = None, plan=None,
                 tree: int | None = None):
        trained = drafter.config.block_size
        self.block_size = block_size or trained
        if not 2 <= self.block_size <= trained:
            raise UserError(f"block size must be in [2, {trained}] for this drafter (trained with {trained})")
        if tree is not None and not 1 <= tree < MAX_TREE_TOKENS:
            raise UserError(f"a tree has 1 to {MAX_TREE_TOKENS - 1} drafts (nodes), got {tree}")
        self.tree_nodes = tree
        drafter.check_fits(target)
        self.drafter, self.target = drafter, target
        self.plan = plan or target.kernel_plan  # the drafter's kernels: int8 ones, or the target's
        self.feature_layers = tuple(drafter.config.target_layer_ids)
        self.max_draft = self.block_size - 1
        self.mask_token_id = drafter.config.mask_token_id
        # Drafts never change the output, only how many are accepted, so the drafter may run in a cheaper dtype
        # than the target, and may score only some rows of the frozen LM head: its draft vocabulary, plus the
        # tokens of the prompt at hand (a drafter copies names and identifiers from it, however rare they are).
        # The base head (the draft vocabulary's rows, or all) is laid out for its kernel once, at load; the prompt's
        # other tokens form a small second head, made per prompt: re-making the whole head per prompt cost 35 ms,
        # and packing it (oneDNN or int8) another 20-80 ms at the first draft.
        head = target.lm_head.weight.detach()
        self.full_head = head if head.dtype == drafter.fc.weight.dtype else head.to(drafter.fc.weight.dtype)
        self.base_vocab = drafter.draft_vocab
        self.base_set = None if self.base_vocab is None else frozenset(self.base_vocab)
        self.base_ids = None if self.base_vocab is None else torch.tensor(sorted(self.base_vocab),
                                                                          device=head.device)
        rows = self.full_head if self.base_ids is None else self.full_head[self.base_ids]
        self.lm_head = FrozenLinear(rows, plan=self.plan)
        self.vocab_ids = self.base_ids  # what the heads' columns are, in order (None: the whole vocabulary)
        self.prompt_rows: torch.Tensor | None = None
        self.reading = StepwiseReading()

    def use_plan(self, plan: KernelPlan) -> None:
        """`plan`'s kernels for the drafter's products and its LM head."""
        self.plan = plan
        self.drafter.use_plan(plan)
        self.lm_head.use_plan(plan)

    def setup_report(self) -> dict:
        rows = min(FIRST_READ or self.max_draft, self.max_draft)
        report = {"draft_head_kernel": self.lm_head.kernel_for_rows(rows)}
        return {**report, "tree_nodes": self.tree_nodes} if self.tree_nodes else report

    def start(self, prompt_ids: list[int], features: torch.Tensor | None) -> None:
        self.cache = self._new_cache(len(prompt_ids) + 256)
        self.pending = [features]
        if self.base_vocab is not None:  # a drafter copies names and numbers from its prompt, however rare
            extra = torch.tensor(sorted(set(prompt_ids) - self.base_set), dtype=torch.long,
                                 device=self.base_ids.device)
            self.prompt_rows = self.full_head[extra] if len(extra) else None
            self.vocab_ids = torch.cat([self.base_ids, extra])

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None:
        self.pending.append(features)

    @property
    def graphs(self) -> DrafterGraphs | None:
        """The drafter's graphed pass, where the target's passes are graphed too (one per drafter, made at first
        use, capturing as the target's do)."""
        target_graphs = getattr(self.target, "graphs", None)
        if target_graphs is None:
            return None
        compiled = getattr(self.target, "graphs_compiled", False)  # --compile: the drafter's pass too
        graphs = self.drafter.__dict__.get("_graphs")
        if graphs is None or (graphs.capture, graphs.compiled) != (target_graphs.capture, compiled):
            graphs = self.drafter.__dict__["_graphs"] = DrafterGraphs(self.drafter, target_graphs.capture, compiled)
        return graphs

    def _new_cache(self, capacity: int):
        """A drafter cache for a new sequence. Under graphs, one made at the target's graph capacity and kept by this
        proposer from one sequence to the next (a graph belongs to its cache's buffers: a new cache per sequence
        would capture anew each time); a copy of this proposer (a batch's other rows) makes its own."""
        if self.graphs is None:
            return self.drafter.new_cache(capacity=capacity)
        capacity = max(capacity, self.target.graph_capacity + 2 * self.block_size + max(WIDTHS))
        kept = self.__dict__.get("_kept_cache")
        if kept is None or kept[0] != id(self) or kept[1].capacity < capacity:
            kept = self.__dict__["_kept_cache"] = (id(self), self.drafter.new_cache(capacity=capacity))
        kept[1].set_lengths([0])
        return kept[1]

    @torch.inference_mode()
    def propose(self, sequence: list[int], limit: int | None = None, keep_going=None) -> Draft:
        start = len(sequence) - 1  # position of the bonus token
        device = self.drafter.fc.weight.device
        pending = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending, dim=1)
        done = self.cache.lengths[0]
        if done + pending.shape[1] != start:
            raise RuntimeError("drafter context out of step with the target")
        block = torch.tensor([[sequence[-1]] + [self.mask_token_id] * self.max_draft], device=device)
        graphs = self.graphs
        if graphs is not None and graphs.handles(pending.shape[1], self.cache, self.block_size):
            hidden = graphs.run(self.target.embed_tokens(block), pending, self.cache)
        else:
            hidden = self.drafter(
                self.target.embed_tokens(block),
                torch.arange(start, start + self.block_size, device=device)[None],
                pending,
                torch.arange(done, start, device=device)[None],
                cache=self.cache,
            )
        self.pending = []
        if self.tree_nodes:
            return self.tree_draft(hidden[:, 1:])
        keep = self.max_draft if limit is None else min(limit, self.max_draft)
        return DFlashProposer._read_in_steps([self], hidden[:, 1: 1 + keep], [keep_going])[0]

    def tree_draft(self, hidden: torch.Tensor) -> Draft:
        """A tree of `tree_nodes` drafts from one row's hidden states at the draft positions [1, drafts, width]: the
        top TREE_TOP_K tokens of each position, kept best first by their probabilities' product along a path. A
        tree of N nodes reaches N positions deep at most: the LM head reads no further."""
        hidden = hidden[:, : self.tree_nodes]
        logits = self.base_logits(hidden)
        if self.prompt_rows is not None:
            logits = torch.cat([logits, F.linear(hidden.reshape(-1, hidden.shape[-1]), self.prompt_rows).float()],
                               dim=-1)
        probabilities, ids = logits.softmax(-1).topk(min(TREE_TOP_K, self.tree_nodes), dim=-1)
        if self.vocab_ids is not None:
            ids = self.vocab_ids[ids]
        candidates = [list(zip(i, p)) for i, p in zip(ids.tolist(), probabilities.tolist())]
        tokens, parents, confidence = best_first(candidates, self.tree_nodes)
        return Draft(tokens, confidence, parents=parents)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows * positions, base vocabulary] of the shared base head, the same for every row."""
        # 2-D on purpose: a 3-D bf16 input took a slow path of the head (44 ms instead of 3 ms); argmax in float32:
        # over bf16 logits it took 2.5 ms for 15 rows, converting first 0.5 ms (same indices)
        return self.lm_head(hidden.reshape(-1, hidden.shape[-1])).float()

    def read_drafts(self, hidden: torch.Tensor, base: torch.Tensor | None = None, runners_up: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, list | None]:
        """(drafts, confidences, alternatives): drafts and confidences [rows, positions] from the drafter's hidden
        states at the draft positions (`base`: their base-head logits, when already computed for a whole batch);
        with `runners_up`, each row's next candidates at each position as (token, probability) pairs, best first
        (Draft.alternatives), else None."""
        rows, positions, width = hidden.shape
        flat = hidden.reshape(-1, width)
        logits = self.base_logits(hidden) if base is None else base
        if self.prompt_rows is not None:
            logits = torch.cat([logits, F.linear(flat, self.prompt_rows).float()], dim=-1)
        probabilities = logits.softmax(-1)  # softmax keeps the order: the same drafts as argmax
        if runners_up:
            confidence, drafts = probabilities.topk(1 + min(runners_up, probabilities.shape[-1] - 1), dim=-1)
        else:
            confidence, drafts = probabilities.max(-1, keepdim=True)
        if self.vocab_ids is not None:
            drafts = self.vocab_ids[drafts]
        alternatives = None
        if runners_up:
            pairs = zip(drafts[:, 1:].tolist(), confidence[:, 1:].tolist())
            flat_alternatives = [list(zip(ids, chances)) for ids, chances in pairs]
            alternatives = [flat_alternatives[r * positions: (r + 1) * positions] for r in range(rows)]
        return drafts[:, 0].view(rows, positions), confidence[:, 0].view(rows, positions), alternatives

    @staticmethod
    @torch.inference_mode()
    def propose_batch(proposers: list["DFlashProposer"], sequences: list[list[int]], keep_goings) -> list[Draft]:
        """Every sequence's block in ONE drafter pass, each row over its own context cache."""
        if len(proposers) == 1:
            return [proposers[0].propose(sequences[0], keep_going=keep_goings[0])]
        first = proposers[0]
        device = first.drafter.fc.weight.device
        contexts = []
        for p, seq in zip(proposers, sequences):
            pending = p.pending[0] if len(p.pending) == 1 else torch.cat(p.pending, dim=1)
            if p.cache.lengths[0] + pending.shape[1] != len(seq) - 1:
                raise RuntimeError("drafter context out of step with the target")
            contexts.append(pending)
            p.pending = []
        blocks = torch.tensor([[seq[-1]] + [first.mask_token_id] * first.max_draft for seq in sequences], device=device)
        starts = torch.tensor([len(seq) - 1 for seq in sequences], device=device)
        positions = starts[:, None] + torch.arange(first.block_size, device=device)
        hidden = first.drafter.forward_rows(first.target.embed_tokens(blocks), positions, contexts,
                                            [p.cache for p in proposers])
        if first.tree_nodes:
            return [p.tree_draft(hidden[r: r + 1, 1:]) for r, p in enumerate(proposers)]
        return DFlashProposer._read_in_steps(proposers, hidden[:, 1:], keep_goings)

    @staticmethod
    def _read_in_steps(proposers: list["DFlashProposer"], hidden: torch.Tensor, keep_goings) -> list[Draft]:
        """Each row's drafts from its hidden states [rows, drafts, width]: FIRST_READ positions, then the rest for
        the rows whose `keep_going(confidences so far)` (the controller's `could_verify_more`) says a further draft
        could still be verified; a row without one reads them all. Every position at once while stepping does not
        pay (`StepwiseReading`), which the answers at FIRST_READ keep measuring."""
        first, total = proposers[0], hidden.shape[1]
        made = [Draft([], []) for _ in proposers]
        if not FIRST_READ or FIRST_READ >= total or all(k is None for k in keep_goings):
            first._read_rows(proposers, hidden, list(range(len(proposers))), 0, total, made)
            return made
        split = FIRST_READ if first.reading.pays() else total
        first._read_rows(proposers, hidden, list(range(len(proposers))), 0, split, made)
        wanting = []
        for r, keep_going in enumerate(keep_goings):
            needed = keep_going is None or keep_going(made[r].confidence[:FIRST_READ])
            if keep_going is not None:  # asked even when all was read: the answers decide whether stepping pays
                first.reading.observe(needed)
            if needed:
                wanting.append(r)
        if split < total and wanting:
            first._read_rows(proposers, hidden, wanting, split, total, made)
        return made

    def _read_rows(self, proposers: list["DFlashProposer"], hidden: torch.Tensor, rows: list[int], start: int,
                   stop: int, made: list[Draft]) -> None:
        """Appends positions start..stop of `rows` to their drafts (with their runners-up where a row wants them)."""
        part = hidden[rows, start:stop] if len(rows) < hidden.shape[0] else hidden[:, start:stop]
        runners_up = max(proposers[r].alternatives for r in rows)
        if self.base_vocab is None:  # one head for every row
            drafts, confidence, alternatives = self.read_drafts(part, runners_up=runners_up)
            read = list(zip(drafts.tolist(), confidence.tolist(), alternatives or [None] * len(rows)))
        else:  # the base head once for these rows (it is every row's), then each row's own prompt tokens
            base = self.base_logits(part).view(len(rows), stop - start, -1)
            read = []
            for i, r in enumerate(rows):
                drafts, confidence, alternatives = proposers[r].read_drafts(part[i: i + 1], base[i],
                                                                            proposers[r].alternatives)
                read.append((drafts[0].tolist(), confidence[0].tolist(), alternatives and alternatives[0]))
        for r, (drafts, confidence, alternatives) in zip(rows, read):
            made[r].tokens += drafts
            made[r].confidence += confidence
            wanted = proposers[r].alternatives
            if wanted:  # the batch read as many as its most wanting row
                made[r].alternatives = (made[r].alternatives or []) + [others[:wanted] for others in alternatives]


def measured_break_even(proposer: DFlashProposer, target, precision: str, repeats: int = 7) -> float:
    """`StepwiseReading.break_even` for `proposer`'s head: timed once per machine, target, drafter dtype and head
    size (cached like the target's pass costs, `cached_timing`)."""
    from ...models.target import cached_timing, interleaved_medians

    first, whole = FIRST_READ or 0, proposer.max_draft
    if not 0 < first < whole:
        return 0.0

    def measure() -> dict:
        hidden = torch.randn(1, whole, target.hidden_size, device=target.device).to(proposer.full_head.dtype)
        median = interleaved_medians({n: lambda n=n: proposer.read_drafts(hidden[:, :n])
                                      for n in sorted({first, whole - first, whole})}, repeats)
        return {"break_even": round(max(0.0, (median[whole] - median[first]) / median[whole - first]), 4)}

    rows = len(proposer.base_vocab) if proposer.base_vocab is not None else proposer.full_head.shape[0]
    head = proposer.lm_head.kernel_for_rows(first)
    return cached_timing(target, f"dflash-read:{precision}:{head}:{rows}x{target.hidden_size}:{first}/{whole}",
                         measure)["break_even"]


# The kernels a drafter's LM head is timed on beside its plan's (settled_kernels), by candidate name
HEAD_KERNELS = {"native": "fused+head", "vnni": "fused+int8-head"}


def settled_kernels(proposer: DFlashProposer, target, plan: KernelPlan, precision: str, repeats: int = 5,
                    seconds=best_drafting_seconds) -> KernelPlan:
    """`plan`, with our kernel for every product of the drafter's layers, and then for its LM head too (float, or
    int8 rows summed with VNNI where the CPU has it), where a drafting pass runs faster that way, timed whole after a
    target step, once per machine (cached like the target's pass costs). Where all of a layer's products use ours,
    the drafter's layers run as ONE C call.

    A drafter in another dtype than the target's has shapes the target's plan never measured, and `covering` times
    those one product at a time, hot in the caches:
    - for a bfloat16 drafter on a float32 target it gave the MLP products oneDNN's kernel, and the layers went back
      to ~25 torch ops each: 5.1 ms a drafting pass after a target step against 3.9 ms with every product ours;
    - the LM head (16K rows of SmolLM2's draft vocabulary) was never measured and took oneDNN's: after a target step
      has evicted it, 4 rows cost 0.77 ms there and 0.65 ms through ours in bfloat16, 1.37 and 1.06 ms in float32
      (AMD EPYC Zen 4, 2 threads, runs of the head alone); as int8 rows through our VNNI kernel, 0.26 ms. Its
      drafts may differ from the float head's where two logits are within its rounding (~1e-2): a choice of speed
      that never changes the output, as a draft dtype is.
    Not for int8 plans, whose products are meant to run on int8 weights. `seconds(proposer, target)`: one drafting
    pass's time, injectable for tests."""
    if plan.float_plan is not None:
        return plan
    drafter = proposer.drafter
    products = [lin for layer in drafter.layers
                for lin in (layer.self_attn.qkv, layer.self_attn.o_fast, layer.mlp.gate_up, layer.mlp.down_fast)]
    fused = with_kernel(plan, products)
    candidates = {"measured": plan}
    head = proposer.lm_head
    # a plan chooses by shape: a head shaped as one of the layers' products (a tiny model's vocabulary as wide as its
    # hidden size) would take that product to the head's kernel too, whose int8 form writes float32 rows
    shared = any((lin.out_features, lin.in_features) == (head.out_features, head.in_features) for lin in products)
    heads = [] if shared else [(name, with_kernel(fused, [head], kernel)) for kernel, name in HEAD_KERNELS.items()]
    for name, candidate in [("fused", fused)] + heads:
        if all(candidate.choices != other.choices for other in candidates.values()):
            candidates[name] = candidate
    if len(candidates) == 1:
        return plan

    def measure() -> dict:
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(repeats):  # interleaved, so that a slower moment weighs on every candidate alike
            for name, candidate in candidates.items():
                proposer.use_plan(candidate)
                times[name].append(seconds(proposer, target))
        return {name: round(1000 * sorted(t)[len(t) // 2], 3) for name, t in times.items()}

    from ...models.target import cached_timing

    shapes = sorted({(lin.out_features, lin.in_features) for lin in products + [proposer.lm_head]})
    timings = cached_timing(target, f"dflash-drafter-kernels:{precision}:{shapes}:{sorted(candidates)}:a-round",
                            measure)
    chosen = candidates[min((name for name in timings if name in candidates), key=timings.get)]
    proposer.use_plan(chosen)
    return chosen


def untrained_drafter(target, num_layers: int = 3, block_size: int = 16, seed: int = 0) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        target.config, target.vocab_size, default_mask_token_id(target.tokenizer, target.vocab_size),
        num_layers=num_layers, block_size=block_size,
    )
    return DFlashDrafter.untrained(cfg, seed).to(device=target.device, dtype=target.dtype)


def load_drafter(path: str | Path | None, target, dtype: torch.dtype | None = None,
                 plan=None) -> tuple[DFlashDrafter, str | None]:
    """The drafter at `path`, else the shipped one for this target, else an untrained one (with a note saying so),
    frozen for inference in `dtype` (default: the target's) with `plan`'s kernels (default: the target's)."""
    dtype = dtype or target.dtype
    note = None
    if path is None:
        path = shipped_drafter(target.name, "dflash")
    elif not Path(path).exists():
        raise folder_not_found(path, "drafter")
    if path is None:
        note = f"no trained drafter ships for {target.name}: using an UNTRAINED drafter (expect tau ~1, no speedup)"
        drafter = untrained_drafter(target).to(dtype)
    else:
        drafter = DFlashDrafter.load(path, dtype=dtype, device=str(target.device))
        drafter.check_fits(target)
    return drafter.freeze(plan or target.kernel_plan), note


def build(target, options: MethodOptions) -> tuple[DFlashProposer, str | None]:
    if options.tree is not None and target.backend == "transformers":
        raise UserError("a tree of drafts needs our own forward (Llama, Qwen3, Gemma3 targets), not the transformers "
                        "fallback this target runs on")
    def make(precision: DraftPrecision) -> tuple[DFlashProposer, str | None]:
        plan = precision.plan_for(target)
        drafter, note = load_drafter(options.drafter, target, precision.dtype, plan)
        if target.measure and target.device.type == "cpu":  # the drafter's own shapes: its feature product, its head
            plan = covering(plan, drafter.frozen_linears(), target.measurement_key("dflash-drafter-kernels"))
            drafter.use_plan(plan)
        proposer = DFlashProposer(drafter, target, options.block_size, plan, options.tree)
        if target.measure and target.device.type == "cpu":
            settled_kernels(proposer, target, plan, precision.name)
        if target.measure:
            proposer.reading.break_even = measured_break_even(proposer, target, precision.name)
        return proposer, note

    return in_draft_dtype("dflash", target, options, make)
