"""What every drafting method provides: a proposer for the ONE verification loop (engine.py), and optionally a
training recipe for `dflash train`. The registry (registry.py) maps names to `Method` objects; nothing outside
`methods/` names a method.

A proposer sees the committed sequence (prompt + output; its last token is the pending "bonus", not yet in the
target's KV cache) and returns draft tokens that should follow it, with the drafter's confidence in each where it
has one. After each verify round the engine calls `commit` with the tokens that entered the target's cache and
their target features, so feature-reading proposers (DFlash, EAGLE-3) can extend their context.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ..models.kernels import FrozenLinear, KernelPlan

SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"


# the label of drafts from a target's continuation table (methods/continuations.py): a match of no prompt tokens,
# calibrated apart from prompt lookup's (labelled by their match's length), and counted apart in the stats
TABLE_LABEL = 0
# the label of drafts a grammar forces (structured.py: a key's name once its quote is open), calibrated apart too
GRAMMAR_LABEL = -1


@dataclass
class Draft:
    tokens: list[int]
    # the drafter's probability of each token (its top-1 softmax probability); None for drafters without one
    confidence: list[float] | None = None
    # for drafts without confidences: what their acceptance is learnt by, beside the position (prompt lookup: the
    # length of the match it copied from); None: position alone
    label: int | None = None
    # a tree of drafts (trees.py): parents[i] is draft i's parent, by block index (0: the bonus, j: draft j - 1),
    # each below its child's; None: a chain
    parents: list[int] | None = None
    # a chain's runner-up candidates at each position read, (token, probability) best first after the draft's own
    # token: where a grammar refuses a draft, the first it allows takes its place (engine.within_grammar); None: none
    alternatives: list[list[tuple[int, float]]] | None = None


class Proposer:
    """No drafts: plain autoregressive decoding through the same engine (the `ar` baseline)."""

    name = "ar"
    feature_layers: tuple[int, ...] = ()
    max_draft = 0
    # True: one pass makes every draft, and `keep_going` asks whether the controller could still verify a draft
    # beyond those read so far (DFlash reads its LM head in steps); False: drafts come one at a time, and it asks
    # whether one more pays for its drafting (EAGLE-3)
    one_pass = False
    report: dict = {}  # how it was set up (e.g. the measured draft dtype), for --json and bench
    # a free proposer (prompt lookup, `dflash+ngram`) whose drafts a round may verify instead of running this one,
    # where the controller expects them to be worth more (control.py); None: none
    lookup: "Proposer | None" = None
    # drafts a tree of this many nodes a round (trees.py), every node verified (the controller prices chains only);
    # None: a chain
    tree_nodes: int | None = None
    # runner-up candidates wanted at each draft position this round (Draft.alternatives), set by the engine for a
    # sequence under a grammar; a proposer that reads a distribution per position provides them, others ignore it
    alternatives: int = 0

    def setup_report(self) -> dict:
        """What its set-up chose beyond the draft dtype (e.g. the kernel of a drafter's LM head), for `report`."""
        return {}

    def start(self, prompt_ids: list[int], features: torch.Tensor | None) -> None:
        """Called once after the target's prefill with the prompt's target features."""

    def propose(self, sequence: list[int], limit: int | None = None,
                keep_going: Callable[[list[float]], bool] | None = None) -> Draft:
        """Up to min(limit, max_draft) drafts to follow `sequence`. A drafter that drafts one token at a time
        (EAGLE-3) asks `keep_going(confidences so far)` before each further draft; a `one_pass` drafter may stop
        reading its drafts where it says no."""
        return Draft([])

    def skip(self) -> None:
        """This round verifies the bonus alone without drafting (the controller found drafting does not pay)."""

    @staticmethod
    def propose_batch(proposers: list["Proposer"], sequences: list[list[int]],
                      keep_goings: list[Callable[[list[float]], bool] | None]) -> list[Draft]:
        """Drafts for several sequences of a batch, each with its own proposer (copies of one template). A drafter
        that can draft them in one pass overrides this; by default each drafts alone."""
        return [p.propose(s, keep_going=k) for p, s, k in zip(proposers, sequences, keep_goings)]

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None:
        """`token_ids` entered the target's cache (the old bonus and the accepted drafts)."""

    def context_backlog(self) -> int:
        """Committed tokens the drafter has not read yet (it reads them in its next drafting pass)."""
        return 0


class FeatureBacklog:
    """For proposers that read target features: those committed since the last drafting pass, in order."""

    pending: list[torch.Tensor | None]

    def context_backlog(self) -> int:
        return sum(f.shape[1] for f in self.pending if f is not None)


@dataclass
class MethodOptions:
    """What a user may say about a method on the command line (generate, serve and bench share these)."""

    drafter: str | None = None  # a drafter folder; None: the one shipped for the target, else an untrained one
    block_size: int | None = None  # tokens verified per round at most: the bonus + block_size - 1 drafts
    draft_dtype: str | None = None  # the drafter's dtype; None: the target's; "auto": the faster one, measured
    continuations: str | None = None  # prompt lookup's continuation table: a folder, "none"; None: the shipped one
    tree: int | None = None  # verify a tree of this many drafts a round (a block drafter's top candidates); None: a chain
    # prompt lookup's longest and shortest match, in tokens (vLLM's prompt_lookup_max / _min); None: ngram.py's
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self):
        """Checked when made, so that the CLI says so before it spends seconds loading the target."""
        from ..errors import UserError
        from ..trees import MAX_TREE_TOKENS

        if self.block_size is not None and self.block_size < 2:
            raise UserError(f"--block-size must be >= 2 (the bonus token and at least one draft), got {self.block_size}")
        if self.block_size is not None and self.block_size > MAX_TREE_TOKENS:
            # a verify pass runs in C up to 64 tokens a row, bitwise as steps (models/transformer.py)
            raise UserError(f"--block-size must be <= {MAX_TREE_TOKENS}, got {self.block_size}")
        if self.tree is not None and not 1 <= self.tree < MAX_TREE_TOKENS:
            raise UserError(f"a tree has 1 to {MAX_TREE_TOKENS - 1} drafts (nodes), got {self.tree}")
        longest, shortest = self.prompt_lookup_max, self.prompt_lookup_min
        if any(n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1) for n in (longest, shortest)):
            raise UserError(f"prompt lookup's matches are whole numbers of tokens >= 1, got max {longest}, "
                            f"min {shortest}")
        if longest is not None and shortest is not None and shortest > longest:
            raise UserError(f"prompt_lookup_min ({shortest}) must be at most prompt_lookup_max ({longest})")


class TrainingRecipe(Protocol):
    """How `dflash train` builds, loads and trains a method's model (implemented by dflash and eagle3)."""

    shape_defaults: dict[str, int]  # shape options of a new model: num_layers, block_size, num_features
    fixed_shape: tuple[str, ...]  # shape options the method does not allow to change ...
    fixed_shape_note: str  # ... and how to say so
    free_on_init: tuple[str, ...]  # shape options that may differ from an --init-from model's (no weight shape)
    own_options: tuple[str, ...]  # training options only this method uses

    def new_model(self, target, config) -> nn.Module: ...

    def load_model(self, folder: Path, target) -> nn.Module: ...

    def shape_of(self, model: nn.Module) -> dict[str, int]: ...

    def objective(self, model: nn.Module, target, config): ...

    def prepare_new(self, objective, train_examples, config) -> None: ...


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    build_proposer: Callable[..., tuple[Proposer, str | None]]  # (target, MethodOptions) -> (proposer, note)
    uses_drafter: bool = False  # whether --drafter means something for it
    training: TrainingRecipe | None = None
    block_size_help: str = field(default="tokens verified per round at most (drafts + 1)")


DRAFT_PRECISIONS = ("float32", "bfloat16", "float16", "int8", "int8-head")
DRAFT_TIMING_TURNS = 5  # rounds of timing every candidate precision once (measured_draft_precision), medians


@dataclass(frozen=True)
class DraftPrecision:
    """How a drafter runs: its weights' and activations' dtype, and the kernels of its products (None: the
    target's plan). "int8" keeps float32 activations and runs the drafter's products (its LM head included) on int8
    weights, all but the one reading the target's raw features: drafts may be inexact, the output cannot be, since
    the target verifies every token. "int8-head" keeps float32 layers (on the target's kernels: our C layers where
    the target runs them) and reads only the LM head, and any other shape the target lacks, in int8."""

    name: str
    dtype: torch.dtype
    plan: object | None = None  # a KernelPlan

    def plan_for(self, target):
        return self.plan if self.plan is not None else target.kernel_plan


def draft_precision(name: str | None, target) -> DraftPrecision:
    from ..errors import UserError
    from ..models.kernels import int8_head_plan, int8_plan, int8_supported
    from ..models.target import DTYPES

    if name is None:
        return DraftPrecision(str(target.dtype).removeprefix("torch."), target.dtype)
    if name in ("int8", "int8-head"):
        if not int8_supported(torch.empty(0, device=target.device)):
            raise UserError("int8 drafting needs a CPU target and a PyTorch build with fbgemm (x86)")
        plan = int8_plan(target.kernel_plan) if name == "int8" else int8_head_plan(target.kernel_plan)
        return DraftPrecision(name, torch.float32, plan)
    if name not in DTYPES:
        raise UserError(f"unknown draft dtype {name!r}; choose one of auto, {', '.join(DRAFT_PRECISIONS)}")
    return DraftPrecision(name, DTYPES[name])


def in_draft_dtype(method: str, target, options: MethodOptions,
                   make: Callable[[DraftPrecision], tuple[Proposer, str | None]]) -> tuple[Proposer, str | None]:
    """`make(precision)` in the precision `options.draft_dtype` names; "auto" first times a drafting pass of
    `make(p)` in each candidate precision (once per machine) and keeps the fastest. The choice goes into
    `proposer.report`."""
    report = {}
    if options.draft_dtype == "auto":
        key = f"{target.name}:{method}:{options.drafter or 'shipped'}:{options.block_size}"
        built: dict[str, Proposer] = {}  # one proposer per precision, timed in turns (measured_draft_precision)

        def seconds_in(precision: DraftPrecision) -> float:
            if precision.name not in built:
                built[precision.name] = make(precision)[0]
            return best_drafting_seconds(built[precision.name], target, runs=1)

        precision, report = measured_draft_precision(target, key, seconds_in)
        built.clear()
    else:
        precision = draft_precision(options.draft_dtype, target)
        report = {"draft_dtype": precision.name, "measured": False}
    proposer, note = make(precision)
    proposer.report = {**report, **proposer.setup_report()}
    return proposer, note


def with_kernel(plan: KernelPlan, linears: list[FrozenLinear], kernel: str = "native") -> KernelPlan:
    """A copy of `plan` with `kernel` ("native", or "vnni" for an int8 LM head) for each of `linears` that has a form
    for it, at a drafting pass's widths: its block, whatever its size, and a single row."""
    from ..models.kernels import KernelPlan, shape_key

    chosen = KernelPlan(dict(plan.choices), plan.default, dict(plan.timings_ms))
    for lin in linears:
        available = lin.has_vnni() if kernel == "vnni" else kernel in lin.kernels()
        if available:
            for bucket in (1, 16):
                chosen.choices[shape_key(lin.out_features, lin.in_features, lin.weight.dtype, bucket)] = kernel
    return chosen


def best_drafting_seconds(proposer: Proposer, target, context: int = 64, accepted: int = 3, runs: int = 3) -> float:
    """Best of `runs` drafting passes (after a warm-up) of a round in its steady state: a fresh `proposer` first
    reads a `context`-token context of random target features (untimed, as after a prompt), then each timed pass
    reads the features of `accepted` newly committed tokens, as after a round that kept a few drafts, whatever the
    drafts. Timed from the context instead, the pass read 64 rows: 3.7 ms for a bfloat16 SmolLM2 drafter against
    the 2.3 ms of a round's (thirty-second session). Each follows a target step, as in a round, since the step's
    weights evict the drafter's from the caches (SmolLM2's 540 MB against a 32 MB L3). Timed back to back instead,
    a bfloat16 drafter (twice int8's bytes) looked the cheaper, 3.5 ms against int8-head's 4.1; after a step it
    took 3.9 against 3.7 (AMD EPYC Zen 4, 2 threads, scripts/draft_cost.py)."""
    import time

    total = context + accepted * (runs + 1)
    width = len(proposer.feature_layers) * target.hidden_size
    features = torch.randn(1, total, width, generator=torch.Generator().manual_seed(0)).to(target.dtype)
    sequence = [5 + i % (target.vocab_size - 5) for i in range(total + 1)]
    cache = target.new_cache(capacity=16)
    step = torch.tensor([[5]], device=target.device)
    proposer.start(sequence[:context], features[:, :context])
    proposer.propose(sequence[:context + 1])
    best = float("inf")
    for run in range(runs + 1):
        end = context + accepted * (run + 1)  # the round kept the old bonus and accepted - 1 drafts
        proposer.commit(sequence[end - accepted:end], features[:, end - accepted:end])
        target.forward(step, cache)
        cache.truncate(0)
        start = time.perf_counter()
        proposer.propose(sequence[:end + 1])
        if run:
            best = min(best, time.perf_counter() - start)
    return best


def target_shape(target_config) -> dict:
    """The widths a drafter copies from its target: hidden and MLP size, heads, KV heads, head size, norm eps, the
    full-attention RoPE base and the context length."""
    from ..models.layers import rope_theta

    heads = target_config.num_attention_heads
    return {
        "hidden_size": target_config.hidden_size,
        "intermediate_size": target_config.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(target_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
        "rope_theta": rope_theta(target_config),
        "max_position_embeddings": getattr(target_config, "max_position_embeddings", 8192),
    }


def check_fits(kind: str, hidden_size: int, vocab_size: int, feature_layers, target) -> None:
    """Raise a UserError naming the first way a drafter of `kind` does not fit `target`."""
    from ..errors import UserError

    if hidden_size != target.hidden_size:
        raise UserError(f"{kind} hidden size {hidden_size} != target hidden size {target.hidden_size}")
    if vocab_size != target.vocab_size:
        raise UserError(f"{kind} vocab size {vocab_size} != target vocab size {target.vocab_size}")
    bad = [i for i in feature_layers if not 0 <= i < target.num_layers]
    if bad:
        raise UserError(f"{kind} feature layers {bad} are out of range for a {target.num_layers}-layer target")


def init_untrained(model: nn.Module, seed: int) -> None:
    """N(0, 0.02) weights for every linear of a new drafter, from a local generator: the global RNG (and so the
    caller's unseeded sampling) is left alone."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, 0.02, generator=generator)


def shipped_drafter(target_name: str, method: str) -> Path | None:
    folder = SHIPPED_DRAFTERS / f"{target_name}-{method}"
    return folder if (folder / "config.json").is_file() else None


def measured_draft_precision(target, key: str, seconds_in: Callable[[DraftPrecision], float]
                             ) -> tuple[DraftPrecision, dict]:
    """The fastest drafting precision on this machine among the target's dtype, bfloat16 and int8 (where the CPU
    has a kernel for it): `seconds_in(p)` times a drafting pass in each (best of a few), once per machine (cached
    with the kernel plans). bf16 halves the bytes but is slow on CPUs without bf16 instructions, int8 quarters them
    at some loss of draft accuracy: measured, never assumed (the acceptance side shows in bench's tau)."""
    from ..models.kernels import STALE_RATIO, cached_measurement, int8_supported

    own = draft_precision(None, target)
    if target.device.type != "cpu" or not target.measure:
        return own, {"draft_dtype": own.name, "measured": False}
    names = [own.name] + [n for n in ("bfloat16", "int8", "int8-head") if n != own.name]
    if not int8_supported(torch.empty(0)):
        names = [n for n in names if not n.startswith("int8")]

    def measure() -> dict:
        # in turns, each round starting one further along: a busy moment of the shared machine weighs on every
        # precision alike. Timed one after the other, a bfloat16 target's DFlash drafter once measured 4.19 ms in
        # bfloat16 against 4.07 in int8-head, whose rounds take 3.7 ms against bfloat16's 2.2-2.3
        times: dict[str, list[float]] = {name: [] for name in names}
        for turn in range(DRAFT_TIMING_TURNS):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                times[name].append(seconds_in(draft_precision(name, target)))
        return {name: round(1000 * statistics.median(seconds), 3) for name, seconds in times.items()}

    def still_fits(timings: dict) -> bool:  # timings taken on a busier machine than this one is now: measure again
        best = min(timings, key=timings.get)
        return best in names and 1000 * seconds_in(draft_precision(best, target)) >= STALE_RATIO * timings[best]

    # per target dtype too: a bfloat16 target's drafting passes cost what a float32 one's do not. The suffix names
    # the code the timings were taken with, so that older ones are not kept: ":rounds-in-turns", since the
    # thirty-second session, times a round's pass (best_drafting_seconds) with EAGLE-3's draft steps in C, the
    # precisions in turns
    key = target.measurement_key(f"{key}:draft-precision:rounds-in-turns")
    timings, measured = cached_measurement(key, measure, still_valid=still_fits)
    name = min(timings, key=timings.get)
    return draft_precision(name, target), {"draft_dtype": name, "draft_ms": timings, "measured_now": measured}
