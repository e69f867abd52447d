"""The one speculative decoding loop shared by every proposer (ar, ngram, dflash, eagle3), for one sequence or many.

prefill -> [propose -> verify the block in one target pass -> accept -> roll back the cache -> feed features back]*

Round bookkeeping: a sequence always ends with the pending *bonus* token (emitted, not yet in the target's cache).
A round verifies [bonus, d_1..d_k]; the target picks t_0..t_k; `a` drafts are accepted; d_1..d_a and t_a are emitted
(a + 1 tokens: the round's tau), the cache keeps bonus and d_1..d_a, and t_a becomes the next bonus.

Batching (`Engine`): the sequences of a batch occupy the first rows of one KV cache, each at its own length. A round
verifies every row in ONE target pass, each row's block padded to the widest (padding is rolled back with the
rejected drafts), and each row accepts on its own. New sequences join at round boundaries (prefilled alone into a
free row); a finished one leaves and the last row moves into its place, so the batch stays packed.
`SpeculativeDecoder` is the same loop with one row.
"""

from __future__ import annotations

import copy
import functools
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from .control import Calibration, CostModel, DraftController, TreeCalibration, batch_width, expected_accepted
from .detokenize import GrowingText, byte_tokens
from .errors import UserError
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from .methods.base import GRAMMAR_LABEL, TABLE_LABEL, Draft, Proposer
from .prediction import PREDICTION_LABEL, PredictedOutput
from .prefixes import PrefixCache
from . import trees
from .sampling import SamplingConfig, accept_length, penalized_logits, pick_tokens
from .grammar import JsonGrammar
from .structured import JsonConstraint, json_vocabulary, output_grammar
from .threads import chooser_for
from .timings import measured_head_saving, measured_pass_costs, measured_screening

# A drafting pass that reads more committed context than this (a new sequence's prompt, or the backlog of many
# skipped rounds) does not time a steady round's drafting; the cost model ignores it.
CATCH_UP_TOKENS = 32

# Where the target defers its logits (TargetModel.defers_logits), a verify pass wider than this runs the LM head
# on its first FIRST_LOGITS positions, then on the rest only for rows that accepted every draft so far. On a CPU the
# head reads its whole matrix whatever the rows, so up to ~8 rows cost about as much as one; the rows past them add
# arithmetic, which a round that rejects early does not need. Whether that pays is measured (measured_head_saving).
FIRST_LOGITS = 8
# Greedy rounds on a target that screens its head (models/screening.py) read the screen for this many positions
# first: up to four rows run against two panels at once, bound by the memory like one row (native.c).
FIRST_SCREENED = 4
PROMPT_LOGITS_CHUNK = 256  # prompt positions whose logits are scored at once (GenerationConfig.prompt_logprobs)
# runner-up candidates a drafter reads at each position for a sequence under a grammar: where the grammar refuses
# its draft, the first of them it allows takes the draft's place (within_grammar)
GRAMMAR_RUNNERS_UP = 7
PREDICTION_PRIOR_TRIALS = 4.0  # trials a position of the prior of predictions' drafts holds (_learn_prediction_prior)
OVERRUN_SMOOTHING = 0.1  # EMA weight of a wide round's "some row needed logits past FIRST_LOGITS"


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the target's EOS ids
    stop_strings: tuple[str, ...] = ()
    include_stop_strings: bool = False  # the text keeps the stop string that ended it (include_stop_str_in_output)
    skip_special_tokens: bool = False  # the text leaves special tokens out (vLLM's; there True by default)
    ignore_eos: bool = False
    # None: no log-probabilities; k >= 0: each emitted token's, with the k most likely at its position (logprobs.py)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for the prompt's tokens after its first
    # "json_object": the output is always (a prefix of) a JSON object; "json_schema": one that `json_schema` allows;
    # "json_schema_or_text": free text, or such a document where the output starts like one (tool calls: tools.py)
    response_format: str | None = None
    json_schema: dict | None = None
    # a reasoning model's output thinks first (reasoning.py): the response format holds what follows `</think>`;
    # "open": the prompt opened the thinking, "optional": the output may open it
    thinking: str | None = None
    # the output the request expects, as token ids (OpenAI's Predicted Outputs, prediction.py): drafted where the
    # output follows it
    prediction: tuple[int, ...] = ()

    def choices(self, n: int) -> list["GenerationConfig"]:
        """This config for each of `n` outputs of one prompt (OpenAI's and vLLM's `n`). Seeded outputs sample with
        seed, seed + 1, ... (as vLLM seeds them), so each is reproducible and they differ; greedy ones are the same."""
        configs = [self]
        for i in range(1, n):
            configs.append(copy.deepcopy(self))
            if self.sampling.seed is not None:
                configs[-1].sampling.seed = self.sampling.seed + i
        return configs

    def decoder(self, target) -> Callable[[list[int]], str]:
        """How the output's tokens become its text, stop strings looked for in it (skip_special_tokens)."""
        return functools.partial(target.decode, skip_special_tokens=True) if self.skip_special_tokens \
            else target.decode

    def stop_ids(self, eos_ids) -> set[int]:
        """The token ids that end a generation: its own stop ids, and the target's EOS ids unless ignore_eos."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for top in (self.logprobs, self.prompt_logprobs):
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise UserError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if self.sampling.min_tokens > self.max_new_tokens:
            raise UserError(f"min_tokens ({self.sampling.min_tokens}) must be at most max_tokens "
                            f"({self.max_new_tokens})")
        if self.sampling.min_tokens and self.response_format is not None:
            raise UserError("min_tokens cannot be combined with a response format: its document may end before")
        barring = [name for name, given in (("allowed_token_ids", self.sampling.allowed_token_ids),
                                            ("bad_words", self.sampling.bad_word_ids)) if given]
        if barring and self.response_format is not None:
            raise UserError(f"{barring[0]} cannot be combined with a response format: the format may need the tokens "
                            "it bars")
        self.grammar()
        self.sampling.validate()

    def grammar(self) -> JsonGrammar | None:
        """The grammar of the response format (structured.py), None for free text."""
        return output_grammar(self.response_format, self.json_schema, self.thinking)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache (prefixes.py)
    new_tokens: int = 0
    block_size: int = 1
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify round (bonus included)
    draft_lengths: list[int] = field(default_factory=list)  # drafts verified per round (the controller's choice)
    skipped_drafting: int = 0  # rounds the controller ran without drafting (drafting did not pay)
    lookup_rounds: int = 0  # rounds that verified free drafts (a lookup's, a prediction's, a grammar's forced bytes)
    table_rounds: int = 0  # rounds that verified drafts of the target's continuation table (ngram's or a lookup's)
    prediction_accepted: int = 0  # drafts of the request's prediction the target accepted (prediction.py)
    prediction_rejected: int = 0  # and those it verified and rejected
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def num_rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, self.num_rounds)

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of rounds in which draft position k (1..block_size-1) was accepted."""
        rounds = max(1, self.num_rounds)
        return [sum(a - 1 >= k for a in self.accept_lengths) / rounds for k in range(1, self.block_size)]

    @property
    def tau_histogram(self) -> list[int]:
        """Counts of rounds by tokens emitted: index i counts rounds that emitted i + 1 tokens."""
        hist = [0] * self.block_size
        for a in self.accept_lengths:
            hist[min(a, self.block_size) - 1] += 1
        return hist

    @property
    def draft_length_histogram(self) -> list[int]:
        """Counts of rounds by drafts verified: index k counts rounds that verified k drafts (a tree's nodes may
        outnumber a block's drafts)."""
        hist = [0] * max(self.block_size, max(self.draft_lengths, default=0) + 1)
        for k in self.draft_lengths:
            hist[k] += 1
        return hist

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first."""
        return 1000 * (self.total_s - self.ttft_s) / max(1, self.new_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(1e-9, self.total_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("num_rounds", "tau", "per_position_acceptance", "tau_histogram", "draft_length_histogram",
                     "tpot_ms", "tokens_per_s"):
            d[name] = getattr(self, name)
        return d


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop id or stop string), "length", or "cancelled"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens` when the config asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first, when asked
    tool_calls: list[dict] | None = None  # a chat reply that called tools (LLM.chat with tools; tools.py)
    reasoning: str | None = None  # a chat reply's thinking, apart from its answer (LLM's reasoning_parser)
    content: str | None = None  # ... and the answer after it (LLM.chat fills both; text holds them as written)
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)  # the prompt as the target read it
    prompt: str | None = None  # ... and as text (LLM fills it: a text prompt as given, else decoded; vLLM's)
    index: int = 0  # which of the prompt's n outputs this is (vLLM's CompletionOutput.index)
    stop_reason: int | str | None = None  # the stop string or stop id that ended it; None: EOS, length (vLLM's)
    # the prompt's other outputs, where it asked for n > 1 (LLM's SamplingParams.n): this result is the first
    more_outputs: list["GenerationResult"] = field(default_factory=list, repr=False)

    @property
    def outputs(self) -> list["GenerationResult"]:
        """vLLM's RequestOutput.outputs: the prompt's outputs (`outputs[0].text`, `.token_ids`), this result first."""
        return [self, *self.more_outputs]

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the output tokens' log-probabilities, where they were asked for (logprobs)."""
        return None if self.logprobs is None else sum(entry.logprob for entry in self.logprobs)

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's: the prompt tokens whose keys and values came from the prefix cache."""
        return self.stats.cached_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        """vLLM's name for `tokens`."""
        return self.tokens


@dataclass
class Plan:
    """What a round verifies for one sequence: the first `verified` tokens of `draft`; `drafted`: the drafter ran
    (for `seconds`); `lookup`: the tokens are a free lookup's (`value`: their expected value, control.py).
    `chances`: in a batch, each draft's calibrated chance of acceptance, for the batch's decision."""

    draft: Draft
    verified: int
    drafted: bool = False
    seconds: float = 0.0
    lookup: bool = False
    value: float = 0.0
    chances: list[float] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """One request in flight: its prompt, settings, proposer state, output so far and statistics."""

    prompt_ids: list[int]
    config: GenerationConfig
    on_tokens: Callable[[list[int]], bool | None] | None
    proposer: Proposer
    controller: DraftController
    max_new: int
    stop_ids: set[int]
    stats: GenerationStats
    started: float = 0.0
    sequence: list[int] = field(default_factory=list)  # prompt + emitted tokens (the last one: the pending bonus)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if the config asks
    prompt_logprobs: list[TokenLogprob] | None = None
    grammar: JsonConstraint | None = None  # what the output may be next (GenerationConfig.response_format)
    prediction: PredictedOutput | None = None  # where the output stands in its prediction (GenerationConfig.prediction)
    features: list[torch.Tensor] = field(default_factory=list)  # of the cached tokens, kept for the prefix cache
    finish: str | None = None
    result: GenerationResult | None = None
    text: GrowingText | None = None  # the output's text, for its stop strings (made at the first check)
    floor: int | None = None  # where its stop strings may end (stop_floor), once min_tokens are written


class Engine:
    """Continuous batching over up to `max_batch` sequences; `step()` admits waiting sequences into free rows and
    runs one round for all of them. Not thread-safe: one thread drives it (the server's worker).

    `adaptive` (the default) lets each sequence's DraftController choose how many drafts to verify, and whether to
    draft at all, from this machine's measured costs (control.py); `adaptive=False` verifies every draft of every
    round (the paper's setting). `timer` is injectable for deterministic tests. `prefix_cache_bytes` > 0 keeps
    prompts' keys/values up to that many bytes, so prompts that start alike skip re-reading it (prefixes.py; our
    forward only, off by default: benchmarks must read every prompt)."""

    def __init__(self, target, proposer: Proposer | None = None, max_batch: int = 1, adaptive: bool = True,
                 timer: Callable[[], float] = time.perf_counter, prefix_cache_bytes: int = 0):
        if max_batch < 1:
            raise UserError(f"max_batch must be >= 1, got {max_batch}")
        self.target = target
        self.proposer = proposer or Proposer()  # a template: each sequence drafts with its own copy
        self.max_batch = max_batch
        self.adaptive, self.timer = adaptive, timer
        self.costs = CostModel()  # the target's pass times on this machine, shared by every sequence
        # the drafter's calibration and its lookup's ("drafter" / "lookup", by drafts a block), shared likewise
        self.calibrations: dict[tuple[str, int], Calibration] = {}
        self.tree_calibration = TreeCalibration()  # the drafter's trees', shared likewise
        if getattr(target, "screen_greedy", False) is None:  # decided once per target, before its passes are timed
            target.screen_greedy = measured_screening(target)
        if adaptive and getattr(target, "measure", False) and (proposer is not None and proposer.max_draft > 0):
            (short, relative), *longer = sorted(measured_pass_costs(target, FIRST_LOGITS, FIRST_SCREENED).items())
            self.costs.seed(relative, short, dict(longer))
            if max_batch > 1:
                self.costs.seed_batches(max_batch * (proposer.max_draft + 1))
        # a wide round computes its logits in two steps while rounds that need the second step are rarer than the
        # second step's share of a whole head (untimed test targets: always)
        wide = proposer is not None and proposer.max_draft + 1 > FIRST_LOGITS and target.defers_logits
        self.head_saving = (measured_head_saving(target, FIRST_LOGITS) if target.measure else 1.0) if wide else 0.0
        self.head_overrun = 0.0  # how often a wide round needed logits past FIRST_LOGITS (EMA)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # row i of the cache holds running[i]
        self.cache = None
        self.batched = max_batch > 1 or target.backend != "transformers"
        self.threads = chooser_for(target.device)  # None: torch's thread count stays as it is (threads.py)
        self.prefixes = (PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0
                         and target.backend != "transformers" else None)

    # ---- requests ------------------------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], config: GenerationConfig | None = None,
               on_tokens: Callable[[list[int]], bool | None] | None = None) -> Sequence:
        """Queue a generation; `on_tokens(new_ids)` is called as tokens are committed, and returning False cancels
        it (a streaming client went away). Bad settings raise UserError here, before anything is queued."""
        config = config or GenerationConfig()
        config.validate()
        if not prompt_ids:
            raise UserError("the prompt is empty")
        max_new = min(config.max_new_tokens, self.budget(prompt_ids))
        stop_ids = config.stop_ids(self.target.eos_token_ids)
        vocab = self.target.vocab_size
        for name, ids in (("the prompt", prompt_ids), ("stop_token_ids", config.stop_token_ids),
                          ("allowed_token_ids", config.sampling.allowed_token_ids)):
            outside = [token for token in ids if not 0 <= token < vocab]  # the embedding would raise an IndexError
            if outside:
                raise UserError(f"{name} must be token ids in [0, {vocab}), got {outside[:20]}")
        allowed = set(config.sampling.allowed_token_ids)
        if allowed and not allowed - (stop_ids if config.sampling.min_tokens else set()):
            raise UserError("allowed_token_ids holds only stop tokens, which min_tokens holds back: the output would "
                            "have no token to write")
        if config.sampling.min_tokens:  # the stop tokens min_tokens holds back
            config = replace(config, sampling=replace(config.sampling, held_back=tuple(sorted(stop_ids))))
        stats = GenerationStats(prompt_tokens=len(prompt_ids), block_size=self.proposer.max_draft + 1)
        lookup = self._calibration("lookup")
        if config.prediction:  # a prediction's drafts are as good as the request: learnt for it, from a light prior
            lookup = copy.deepcopy(lookup)
            prior = self._calibration("prediction").counts(PREDICTION_LABEL)
            lookup.set_counts(PREDICTION_LABEL, *prior)
        controller = DraftController(self.proposer.max_draft, self.costs, whole_blocks=not self.adaptive,
                                     timer=self.timer, calibration=self._calibration("drafter"),
                                     lookup_calibration=lookup, tree_calibration=self.tree_calibration)
        seq = Sequence(list(prompt_ids), config, on_tokens, self._fresh_proposer(), controller, max_new, stop_ids,
                       stats, started=time.perf_counter())
        grammar = config.grammar()
        if grammar is not None:
            vocabulary = json_vocabulary(self.target.tokenizer, self.target.vocab_size)
            seq.grammar = JsonConstraint(vocabulary, grammar, stop_ids)
        if config.prediction:
            seq.prediction = PredictedOutput(config.prediction, prior)
        self.waiting.append(seq)
        return seq

    def _learn_prediction_prior(self, seq: Sequence) -> None:
        """Fold what a request learnt of its prediction's drafts into the prior the next ones start from, scaled
        to at most PREDICTION_PRIOR_TRIALS trials a position: enough to start where predictions usually are (a
        fresh one verified 2-6 drafts a round for its first rounds), little enough that a request learns its own."""
        tried, hits = seq.controller.lookup_calibration.counts(PREDICTION_LABEL)
        started_tried, started_hits = seq.prediction.prior  # what it started from: not learnt by it
        prior = self._calibration("prediction")
        old_tried, old_hits = prior.counts(PREDICTION_LABEL)
        new_tried = [a + b - s for a, b, s in zip(old_tried, tried, started_tried)]
        new_hits = [a + b - s for a, b, s in zip(old_hits, hits, started_hits)]
        scale = min(1.0, PREDICTION_PRIOR_TRIALS / max(max(new_tried, default=0), 1e-9))
        prior.set_counts(PREDICTION_LABEL, [t * scale for t in new_tried], [h * scale for h in new_hits])

    def _calibration(self, of: str) -> Calibration:
        drafts = self.proposer.max_draft
        return self.calibrations.setdefault((of, drafts), Calibration(max(1, drafts)))

    def _fresh_proposer(self) -> Proposer:
        # one sequence at a time may use the template itself; a batch needs one drafting state per row
        return self.proposer if self.max_batch == 1 else copy.copy(self.proposer)

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence at the next round boundary (or drop it if it has not started)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._finish(seq, "cancelled")
        elif seq.finish is None:
            seq.finish = "cancelled"

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt `budget` takes (one that leaves room for a token and a verify block)."""
        return self.target.max_context - max(self.proposer.max_draft, self.proposer.tree_nodes or 0) - 2

    def budget(self, prompt_ids: list[int]) -> int:
        """How many tokens may follow `prompt_ids` (a verify block must still fit the context); UserError if none."""
        budget = self.max_prompt_tokens + 1 - len(prompt_ids)
        if budget < 1:
            limit = self.max_prompt_tokens
            raise UserError(
                f"prompt of {len(prompt_ids)} tokens does not fit the target's context of {self.target.max_context} "
                f"(at most {limit} prompt tokens with this method); shorten the prompt"
            )
        return budget

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Admit waiting sequences into free rows, then run one round for every running one. Returns the sequences
        that finished during this step (their `.result` is set)."""
        if self.threads:  # this engine's thread count for the step; torch's own is restored after it
            self.threads.set_threads(self.threads.current)
        try:
            while self.waiting and len(self.running) < self.max_batch:
                self._prefill(self.waiting.popleft())
            finished = self._retire()  # done at their first token, or cancelled
            if self.running:
                self._round()
            return finished + self._retire()
        finally:
            if self.threads:
                self.threads.set_threads(self.threads.counts[0])

    def _retire(self) -> list[Sequence]:
        done = [seq for seq in self.running if seq.finish is not None]
        for seq in done:
            if seq.sequence:  # its history, for the prompt of a conversation's next turn
                self._store_prefix(seq, self.running.index(seq), len(seq.sequence) - 1)
            self._leave(seq)
            self._finish(seq, seq.finish)
        return done

    def _prefill(self, seq: Sequence) -> None:
        """The prompt into the next free row; samples the first token (TTFT)."""
        row = len(self.running)
        out = self._read_prompt(seq, row)
        if seq.config.prompt_logprobs is not None:
            seq.prompt_logprobs = self._prompt_logprobs(seq, out)
        last = out.logits[0, -1:] if out.logits is not None else self.target.logits_of(out.hidden[0, -1:])
        first = self._choose(last[None], [seq], [1], drafts=[[]], history=seq.prompt_ids)[0]
        seq.proposer.start(list(seq.prompt_ids), out.features)
        seq.stats.ttft_s = time.perf_counter() - seq.started
        seq.sequence += first
        self.running.append(seq)
        self._emit(seq, first, self._logprobs(seq, last, first))

    def _read_prompt(self, seq: Sequence, row: int):
        """Run the prompt into `row` of the cache, after the longest prefix of it the prefix cache holds (unless it
        is to be scored: that needs every position's logits). Returns the pass's output, its features the whole
        prompt's; the prompt becomes the sequence and a prefix cache entry."""
        cache = self._row_cache(row, len(seq.prompt_ids) + 1)
        scored = seq.config.prompt_logprobs is not None
        cached, known = self._restore_prefix(seq, row, cache) if not scored else (None, 0)
        logits_at = "last" if not scored else "hidden" if self.target.defers_logits else "all"
        out = self.target.forward(torch.tensor([seq.prompt_ids[known:]], device=self.target.device), cache,
                                  seq.proposer.feature_layers, logits_at=logits_at)
        self._release_row_cache(cache, row)
        if cached is not None and out.features is not None:
            out.features = torch.cat([cached.features[:, :known], out.features], dim=1)
        if self.prefixes is not None and out.features is not None:
            seq.features = [out.features]
        seq.sequence = list(seq.prompt_ids)
        self._store_prefix(seq, row, len(seq.prompt_ids))
        return out

    def _restore_prefix(self, seq: Sequence, row: int, cache):
        """Copy the longest stored prefix of the prompt into the row (a view of it: `cache`). Returns the entry and
        how many prompt tokens it holds, or (None, 0)."""
        hit = self.prefixes.longest(seq.prompt_ids) if self.prefixes is not None else None
        if hit is None or (seq.proposer.feature_layers and hit[0].features is None):
            return None, 0
        entry, known = hit
        self.cache.keys[:, row, :, :known] = entry.keys[:, :, :known]
        self.cache.values[:, row, :, :known] = entry.values[:, :, :known]
        cache.lengths[0] = known
        seq.stats.cached_prompt_tokens = known
        return entry, known

    def _store_prefix(self, seq: Sequence, row: int, length: int) -> None:
        """Keep the first `length` tokens of the sequence that `row` of the cache holds."""
        if self.prefixes is not None:
            features = torch.cat(seq.features, dim=1)[:, :length] if seq.features else None
            self.prefixes.store(seq.sequence[:length], self.cache.keys[:, row, :, :length],
                                self.cache.values[:, row, :, :length], features)

    def _row_cache(self, row: int, room: int):
        """A cache for prefilling `row`: a view of the batch cache, or (transformers fallback) a fresh one."""
        if not self.batched:
            self.cache = self.target.new_cache(capacity=room)
            return self.cache
        if self.cache is None:
            self.cache = self.target.new_cache(batch=self.max_batch, capacity=max(256, room))
        self.cache.reserve(room)
        self.cache.lengths[row] = 0
        return self.cache.view(row, row + 1)

    def _release_row_cache(self, cache, row: int) -> None:
        if self.batched:
            self.cache.take_lengths(cache, row)

    def _draft_all(self, rows: list[Sequence]) -> tuple[list[Plan], bool]:
        """Each sequence's plan for the round: the ones whose controller says drafting pays draft together, in
        one pass where the drafter can; a sequence with a free lookup (`proposer.lookup`) verifies the lookup's
        drafts instead where they are worth more. Also whether the drafting pass read a long context backlog.
        In a batch the number of drafts each row verifies is then decided for the batch as a whole (`_share_width`)."""
        shared = len(rows) > 1 and self.adaptive and self.costs.known
        drafting, lookups = [], {}
        for seq in rows:
            seq.controller.rows, seq.controller.context = len(rows), len(seq.sequence) - 1
            lookups[id(seq)] = self._lookup(seq, shared)
            if seq.controller.should_draft(lookups[id(seq)].value):
                drafting.append(seq)
            else:
                seq.proposer.skip()
                seq.stats.skipped_drafting += 1
        drafts, catching_up = {}, False
        if drafting:
            # a row still reading a long context backlog (its prompt) makes this pass no measure of a steady round
            catching_up = max(s.proposer.context_backlog() for s in drafting) > CATCH_UP_TOKENS
            for seq in drafting:  # a grammar may take a runner-up where it refuses a draft
                seq.proposer.alternatives = GRAMMAR_RUNNERS_UP if seq.grammar is not None else 0
            started = self.timer()
            made = type(drafting[0].proposer).propose_batch(
                [s.proposer for s in drafting], [s.sequence for s in drafting],
                [_keep_going(s) for s in drafting])
            share = (self.timer() - started) / len(drafting)  # what each sequence's drafting adds to the round
            drafts = {id(s): (within_grammar(s, d), share) for s, d in zip(drafting, made)}
        planned = []
        for seq in rows:
            lookup = lookups[id(seq)]
            if id(seq) not in drafts:
                planned.append(lookup if lookup.verified else Plan(Draft([]), 0))
                continue
            draft, seconds = drafts[id(seq)]
            available = min(len(draft.tokens), seq.proposer.tree_nodes or seq.proposer.max_draft)
            if shared:  # the batch decides how many; the drafts expected to bring more are the candidates
                chances = seq.controller.acceptance(available, draft.confidence, draft.label,
                                                    tree=draft.parents is not None)
                plan = Plan(draft, available, drafted=True, seconds=seconds, value=expected_accepted(chances)[-1],
                            chances=chances)
                if lookup.verified and lookup.value > plan.value:
                    plan.draft, plan.verified, plan.lookup = lookup.draft, lookup.verified, True
                    plan.value, plan.chances = lookup.value, lookup.chances
                planned.append(plan)
                continue
            chosen = seq.controller.choose(draft.confidence, available, draft.label, tree=draft.parents is not None)
            plan = Plan(draft, chosen, drafted=True, seconds=seconds)
            drafter_value = seq.controller.chosen_value
            if lookup.verified and drafter_value is not None and lookup.value > drafter_value:
                plan.draft, plan.verified, plan.lookup = lookup.draft, lookup.verified, True
            planned.append(plan)
        if shared:
            self._share_width(rows, planned)
        return planned, catching_up

    @staticmethod
    def _lookup(seq: Sequence, shared: bool = False) -> Plan:
        """The round's plan with free drafts (verified = 0 where there are none or none pays): the lookup's, or the
        bytes the sequence's grammar forces, whichever is worth more. `shared`: the batch decides how many to
        verify; `verified` is every draft, `value` their expected accepted count."""
        plans = [Engine._lookup_plan(seq, draft, shared) for draft in free_drafts(seq)]
        return max(plans, key=lambda plan: plan.value, default=Plan(Draft([]), 0))

    @staticmethod
    def _lookup_plan(seq: Sequence, draft: Draft, shared: bool) -> Plan:
        if shared:
            chances = seq.controller.acceptance(len(draft.tokens), None, draft.label, lookup=True)
            return Plan(draft, len(chances), lookup=True, value=expected_accepted(chances)[-1], chances=chances)
        verified, value = seq.controller.lookup_choice(len(draft.tokens), draft.label)
        return Plan(draft, verified, lookup=True, value=value)

    def _share_width(self, rows: list[Sequence], planned: list[Plan]) -> None:
        """Every row waits for a pass as wide as the batch's widest block, so how many drafts the rows verify is
        one decision (control.batch_width): each row verifies up to the same number, where the drafts it brings
        the whole batch outweigh the wider pass at the batch's rate. A drafted row's share of that value is what
        its controller learns drafting is worth (its `chosen_value`)."""
        acceptances = [plan.chances[: plan.verified] for plan in planned]
        context = sum(seq.controller.context for seq in rows) // len(rows)
        plain = 1 / max(self.costs.cost(len(rows), context), 1e-9)  # a new row's rate: a plain step's
        rate = sum(plain if seq.controller.rate is None else seq.controller.rate for seq in rows)
        width, value = batch_width(acceptances, self.costs, rate, context)
        expected = [expected_accepted(a[:width])[-1] for a in acceptances]
        total = sum(expected)
        for seq, plan, gain in zip(rows, planned, expected):
            plan.verified = min(width, plan.verified)
            if plan.drafted:
                seq.controller.chosen_value = value * gain / total if total > 0 else 0.0

    def _round(self) -> None:
        """One propose / verify / accept round over every running sequence, in one target pass."""
        rows = self.running
        planned, catching_up = self._draft_all(rows)
        if any(plan.draft.parents is not None and plan.verified for plan in planned):
            return self._tree_round(rows, planned, catching_up)
        drafts = [plan.draft.tokens[: plan.verified] for plan in planned]
        blocks = [[seq.sequence[-1]] + d for seq, d in zip(rows, drafts)]
        width = max(len(b) for b in blocks)
        padded = [b + [b[-1]] * (width - len(b)) for b in blocks]  # padding is verified and rolled back
        starts = [len(seq.sequence) - 1 for seq in rows]
        layers = rows[0].proposer.feature_layers
        cache, started = self._before_pass(starts, width)
        screened = self.target.screens and all(screenable(seq) for seq in rows)
        deferred = screened or (width > FIRST_LOGITS and self.head_overrun < self.head_saving)
        out = self.target.forward(torch.tensor(padded, device=self.target.device), cache, layers,
                                  logits_at="hidden" if deferred else "all")
        widths = [len(b) for b in blocks]
        if deferred:
            chosen = self._choose_in_steps(out.hidden, rows, drafts, widths, screened)
        else:
            chosen = self._choose(out.logits, rows, widths, drafts=drafts)  # the host sync: the pass has run
        verify_seconds = self._after_pass(started, planned, starts, width, catching_up)
        lengths = []
        for i, seq in enumerate(rows):
            accepted = accept_length(drafts[i], chosen[i])
            lengths.append(starts[i] + accepted + 1)
            features = out.features[i: i + 1, : accepted + 1] if out.features is not None else None
            if seq.config.logprobs is not None:  # the logits of the accepted positions, where they were deferred
                logits = out.logits[i] if not deferred else self.target.logits_of(out.hidden[i, : accepted + 1])
                logits = logits[: accepted + 1]
            else:
                logits = None
            self._settle(seq, planned[i], blocks[i][: accepted + 1], chosen[i][accepted], features, logits,
                         verify_seconds, len(rows) * width, catching_up)
        if width > FIRST_LOGITS:
            overran = max(length - start for length, start in zip(lengths, starts)) > FIRST_LOGITS
            self.head_overrun += OVERRUN_SMOOTHING * (overran - self.head_overrun)
        self._set_lengths(cache, lengths)

    def _before_pass(self, starts: list[int], width: int):
        """The cache a round's pass writes (the batch's running rows, with room for `width` more tokens each) and
        the time it starts."""
        cache = self.cache
        if self.batched:
            self.cache.reserve(max(starts) + width)
            cache = self.cache.view(0, len(starts), spare_after=True)  # rows stay packed: the rest are free
        if self.threads:
            self.threads.before_pass()
        return cache, self.timer()

    def _after_pass(self, started: float, planned: list[Plan], starts: list[int], width: int,
                    catching_up: bool) -> float:
        """The pass's seconds (chosen tokens read back), told to the thread chooser and the cost model."""
        seconds = self.timer() - started
        if self.threads:
            seconds = self._timed_threads(seconds, len(starts) * width)
        shares = [plan.seconds for plan in planned if plan.drafted]
        self.costs.observe_round(len(starts) * width, seconds, sum(starts) // len(starts),
                                 shares[0] if shares and not catching_up else None)
        return seconds

    def _set_lengths(self, cache, lengths: list[int]) -> None:
        """The rows' lengths after a round (the rejected drafts rolled back), in the batch cache too."""
        cache.set_lengths(lengths)
        if self.batched:
            self.cache.take_lengths(cache, 0)

    def _settle(self, seq: Sequence, plan: Plan, kept: list[int], bonus: int, features: torch.Tensor | None,
                logits: torch.Tensor | None, verify_seconds: float, width: int, catching_up: bool,
                path: list[int] | None = None) -> None:
        """A row's round is decided: `kept` (the old bonus and the accepted drafts) entered the target's cache with
        their `features`, `bonus` is the target's next token; `logits` (where the row asked for log-probabilities)
        chose the emitted tokens; `path`: the accepted nodes of a tree, the root first. Tells the proposer and the
        controller, emits, and counts."""
        accepted = len(kept) - 1
        seq.proposer.commit(kept, features)
        if seq.features and features is not None:
            seq.features.append(features)
        seq.controller.record(plan.drafted, plan.draft.confidence, plan.verified, accepted,
                              plan.seconds, verify_seconds, width=width, catching_up=catching_up,
                              lookup=plan.lookup, label=plan.draft.label, costs_read=True,
                              accepted_nodes=path[1:] if plan.draft.parents is not None and path else None)
        seq.stats.lookup_rounds += plan.lookup and plan.verified > 0
        seq.stats.table_rounds += plan.verified > 0 and plan.draft.label == TABLE_LABEL
        if plan.draft.label == PREDICTION_LABEL and plan.verified > 0:
            seq.stats.prediction_accepted += accepted
            seq.stats.prediction_rejected += min(plan.verified, len(plan.draft.tokens)) - accepted
        seq.stats.draft_lengths.append(min(plan.verified, len(plan.draft.tokens)))
        new_tokens = kept[1:] + [bonus]
        seq.sequence += new_tokens
        logprobs = self._logprobs(seq, logits, new_tokens) if logits is not None else None
        committed = self._emit(seq, new_tokens, logprobs)
        # tau counts committed tokens (DFLASH_SPEC): a round cut by the length limit or a stop counts what it kept
        seq.stats.accept_lengths.append(committed)

    def _tree_round(self, rows: list[Sequence], planned: list[Plan], catching_up: bool) -> None:
        """A round where some row verifies a tree of drafts (trees.py): every row's nodes in ONE pass with a tree
        mask (a chain is a tree too), each row walking its tree from the root; the accepted path's keys and values
        then move into consecutive slots. A tree's accepted nodes are not a prefix of its block, so the stepped head
        of a chain round does not apply: greedy rows read every node's token, sampled rows the logits of the nodes
        their walk visits."""
        nodes, parents = [], []
        for seq, plan in zip(rows, planned):
            tokens = plan.draft.tokens[: plan.verified]
            nodes.append([seq.sequence[-1]] + tokens)
            parents.append([-1] + (plan.draft.parents[: plan.verified] if plan.draft.parents is not None
                                   else list(range(len(tokens)))))
        width = max(len(n) for n in nodes)
        for n, p in zip(nodes, parents):  # padding: leaves under the root, rolled back with the rejected nodes
            p += [0] * (width - len(n))
            n += [n[0]] * (width - len(n))
        starts = [len(seq.sequence) - 1 for seq in rows]
        cache, started = self._before_pass(starts, width)
        screened = self.target.screens and all(screenable(seq) for seq in rows)
        device = self.target.device
        out = self.target.forward(torch.tensor(nodes, device=device), cache, rows[0].proposer.feature_layers,
                                  logits_at="hidden" if screened or self.target.defers_logits else "all",
                                  tree=torch.tensor(parents))
        logits = out.logits

        def logits_at(i: int, nodes_of_row) -> torch.Tensor:  # where the pass deferred them: only those asked for
            return logits[i, nodes_of_row] if logits is not None else self.target.logits_of(out.hidden[i, nodes_of_row])

        if screened:
            greedy = self.target.greedy_of(out.hidden).tolist()  # the host sync: the pass has run
        else:
            greedy_rows = [i for i, seq in enumerate(rows) if plain_greedy(seq)]
            greedy = dict(zip(greedy_rows, (logits_at(greedy_rows, slice(None)).argmax(-1).tolist()
                                            if greedy_rows else [])))
        walked = []
        for i, seq in enumerate(rows):
            if plain_greedy(seq):
                walked.append(trees.walk(parents[i], nodes[i], lambda path, i=i: greedy[i][path[-1]]))
                continue

            def pick(path, i=i, seq=seq):  # given the path (the nodes it visits only); a sample seeded by position
                past = [nodes[i][k] for k in path[1:]]
                if screened:  # greedy under a grammar: the screen's token where the grammar allows it
                    hidden = out.hidden[i, path[-1]: path[-1] + 1]
                    return self._grammar_checked(seq, [greedy[i][path[-1]]], hidden, past, len(past))[0]
                at = logits_at(i, slice(path[-1], path[-1] + 1))[None]
                return self._choose(at, [seq], [1], drafts=[[]], history=seq.sequence + past)[0][0]
            walked.append(trees.walk(parents[i], nodes[i], pick))
        verify_seconds = self._after_pass(started, planned, starts, width, catching_up)
        for i, (seq, (path, bonus)) in enumerate(zip(rows, walked)):
            cache.keep_path(i, starts[i], path)
            features = out.features[i: i + 1, path] if out.features is not None else None
            row_logits = logits_at(i, path) if seq.config.logprobs is not None else None
            self._settle(seq, planned[i], [nodes[i][k] for k in path], bonus, features, row_logits,
                         verify_seconds, len(rows) * width, catching_up, path)
        self._set_lengths(cache, [start + len(path) for start, (path, _) in zip(starts, walked)])

    def _timed_threads(self, seconds: float, tokens: int) -> float:
        """Tell the thread chooser what the pass cost; returns the seconds the cost model should learn: a probe's
        pass ran on another thread count, so the model learns the current count's expected time instead."""
        relative = self.costs.relative_cost(tokens)
        probe = self.threads.probing is not None
        self.threads.after_pass(seconds / relative)
        return self.threads.average[self.threads.current] * relative if probe else seconds

    @staticmethod
    def _choose(logits: torch.Tensor, rows: list[Sequence], widths: list[int], offset: int = 0,
                drafts: list[list[int]] | None = None, history: list[int] | None = None) -> list[list[int]]:
        """The target's token at every verified position of every row (logits[i, j] is position offset + j of row
        i's block, which follows the row's sequence and drafts[i][:offset + j]; `history`: the sequence, where it
        is not the row's yet), with one host sync when all are greedy without penalties. Other rows are picked
        position by position and stop at their first rejected draft: acceptance reads no further, and processing
        a distribution (top-k, top-p, the CDF over the vocabulary) costs ~0.5 ms a position on a CPU."""
        if all(plain_greedy(seq) for seq in rows):
            picked = logits.argmax(-1).tolist()
            return [p[:w] for p, w in zip(picked, widths)]
        chosen = []
        for i, (seq, w) in enumerate(zip(rows, widths)):
            cfg, row_logits = seq.config.sampling, logits[i, :w]
            block = drafts[i][offset:] if drafts is not None else None
            if cfg.penalized_after(len(seq.output)):
                before = (history or seq.sequence) + drafts[i][:offset]
                row_logits = penalized_logits(row_logits, cfg, before, len(seq.prompt_ids), block)
            first, picked = len(history or seq.sequence) + offset, []
            if seq.grammar is not None:  # the tokens past the committed output before this block's first position
                row_drafts = drafts[i] if drafts is not None else []
                past = (history or seq.sequence)[len(seq.prompt_ids) + len(seq.output):] + row_drafts[:offset]
            for j in range(w):
                at = row_logits[j: j + 1]
                if seq.grammar is not None:
                    at = grammar_masked(at, seq, past + row_drafts[offset: offset + j])
                picked += pick_tokens(at, cfg, first + j).tolist()
                if block is not None and (j >= len(block) or picked[-1] != block[j]):
                    break
            chosen.append(picked)
        return chosen

    def _choose_in_steps(self, hidden: torch.Tensor, rows: list[Sequence], drafts: list[list[int]],
                         widths: list[int], screened: bool = False) -> list[list[int]]:
        """What `_choose` returns up to each row's first rejected draft, which is all acceptance reads: the LM
        head runs on the first FIRST_LOGITS positions, then on the rest for the rows that accepted all of them.
        Each position picks its token exactly as `_choose` would (a seeded sample by its sequence position).
        `screened` (every row greedy): the tokens come from the head's screen, FIRST_SCREENED positions first."""
        chosen: list[list[int]] = [[] for _ in rows]
        pending, start = list(range(len(rows))), 0
        while pending:
            stop = max(widths[i] for i in pending)
            if start == 0:
                stop = min(stop, FIRST_SCREENED if screened else FIRST_LOGITS)
            rows_hidden = hidden[pending, start:stop] if len(pending) < len(rows) else hidden[:, start:stop]
            cut = [max(0, min(widths[i], stop) - start) for i in pending]
            if screened:
                picked = [p[:w] for p, w in zip(self.target.greedy_of(rows_hidden).tolist(), cut)]
                picked = [tokens if rows[i].grammar is None
                          else self._grammar_checked(rows[i], tokens, rows_hidden[k], drafts[i], start)
                          for k, (i, tokens) in enumerate(zip(pending, picked))]
            else:
                picked = self._choose(self.target.logits_of(rows_hidden), [rows[i] for i in pending], cut, start,
                                      [drafts[i] for i in pending])
            for i, tokens in zip(pending, picked):
                chosen[i] += tokens
            pending = [i for i in pending
                       if len(chosen[i]) < widths[i] and chosen[i] == drafts[i][: len(chosen[i])]]
            start = stop
        return chosen

    def _grammar_checked(self, seq: Sequence, greedy: list[int], hidden: torch.Tensor, draft: list[int],
                         offset: int) -> list[int]:
        """A grammar row's tokens from the screen's greedy ones (positions offset, offset + 1, ... of its block): where
        the unconstrained argmax is allowed it is also the constrained one, so only a refused position's logits are
        computed, and masked. Stops where the draft is rejected, as acceptance does."""
        chosen = []
        for j, token in enumerate(greedy):
            allowed = seq.grammar.mask(seq.output, draft[: offset + j])
            if not allowed[token]:
                logits = self.target.logits_of(hidden[j: j + 1])
                token = int(logits.masked_fill(~allowed.to(logits.device), float("-inf")).argmax())
            chosen.append(token)
            if offset + j >= len(draft) or token != draft[offset + j]:
                break
        return chosen

    def _prompt_logprobs(self, seq: Sequence, out) -> list[TokenLogprob]:
        """The prompt's tokens' log-probabilities after the first, PROMPT_LOGITS_CHUNK positions of logits at a
        time where the pass left them to `logits_of` (a long prompt's logits would take gigabytes at once)."""
        prompt, top = seq.prompt_ids, seq.config.prompt_logprobs
        entries = []
        for start in range(0, len(prompt) - 1, PROMPT_LOGITS_CHUNK):
            stop = min(start + PROMPT_LOGITS_CHUNK, len(prompt) - 1)
            logits = (out.logits[0, start:stop] if out.logits is not None
                      else self.target.logits_of(out.hidden[0, start:stop]))
            entries += token_logprobs(logits, prompt[start + 1: stop + 1], top)
        return entries

    @staticmethod
    def _logprobs(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """The tokens' log-probabilities from the logits that chose them, if the sequence asked for them."""
        if seq.config.logprobs is None:
            return None
        return token_logprobs(logits, tokens, seq.config.logprobs)

    def _emit(self, seq: Sequence, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Commit emitted tokens (and their log-probabilities) to the output, cut at stops; tell the listener.
        Returns how many were committed."""
        new_tokens, finish = self._check_stops(seq, new_tokens)
        seq.output += new_tokens
        if logprobs is not None:
            seq.logprobs += logprobs[: len(new_tokens)]
        if seq.on_tokens is not None and new_tokens and seq.on_tokens(new_tokens) is False:
            finish = finish or "cancelled"
        if finish and seq.finish is None:
            seq.finish = finish
        return len(new_tokens)

    def _leave(self, seq: Sequence) -> None:
        """Free the sequence's row: the last row moves into it, so rows stay packed."""
        row, last = self.running.index(seq), len(self.running) - 1
        if self.batched and row != last:
            self.cache.move_row(last, row)
        self.running[row] = self.running[last]
        self.running.pop()

    def _finish(self, seq: Sequence, finish: str) -> Sequence:
        seq.finish = finish
        if seq.prediction is not None:
            self._learn_prediction_prior(seq)
        stats = seq.stats
        stats.total_s = time.perf_counter() - seq.started
        stats.new_tokens = len(seq.output)
        output = seq.output
        ends_with_stop_id = finish == "stop" and output and output[-1] in seq.stop_ids
        decode = seq.config.decoder(self.target)
        text = decode(output[:-1] if ends_with_stop_id else output)
        floor = stop_floor(decode, output, seq.config.sampling.min_tokens)
        found = None if floor is None else first_stop_string(text, seq.config.stop_strings, floor)
        # vLLM's stop_reason: the stop string or stop id that ended the output; None for EOS or the length
        stop_reason = found[2] if found is not None else output[-1] if ends_with_stop_id and (
            seq.config.ignore_eos or output[-1] not in self.target.eos_token_ids) else None
        if found is not None:
            text = text[:found[1] if seq.config.include_stop_strings else found[0]]
        logprobs = seq.logprobs if seq.config.logprobs is not None else None
        seq.result = GenerationResult(tokens=output, text=text, finish_reason=finish, stats=stats, logprobs=logprobs,
                                      prompt_logprobs=seq.prompt_logprobs, prompt_token_ids=seq.prompt_ids,
                                      stop_reason=stop_reason)
        return seq

    def _check_stops(self, seq: Sequence, new_tokens: list[int]) -> tuple[list[int], str | None]:
        """Cut `new_tokens` at the first stop id, the length limit or a completed stop string (one that ends past
        the first min_tokens - 1 tokens' text, stop_floor)."""
        output, stop_strings = seq.output, seq.config.stop_strings
        for i, tok in enumerate(new_tokens):
            if tok in seq.stop_ids:
                return new_tokens[: i + 1], "stop"
            if len(output) + i + 1 >= seq.max_new:
                return new_tokens[: i + 1], "length"
        if not stop_strings:
            return new_tokens, None
        least = seq.config.sampling.min_tokens
        text = seq.text = seq.text or GrowingText(seq.config.decoder(self.target), byte_tokens(self.target.tokenizer))
        floor = seq.floor = seq.floor if seq.floor is not None else stop_floor(text, output + new_tokens, least)
        if floor is not None and stop_string_at(text(output + new_tokens), stop_strings, floor) >= 0:
            for i in range(max(0, least - len(output) - 1), len(new_tokens)):
                if stop_string_at(text(output + new_tokens[: i + 1]), stop_strings, floor) >= 0:
                    return new_tokens[: i + 1], "stop"
        return new_tokens, None

    def run(self, on_finished: Callable[[list[Sequence]], None] | None = None) -> list[Sequence]:
        """Step until every submitted sequence has finished; returns them in the order they finished, and hands
        each step's to `on_finished` (a progress bar). The target's weights are checked at the first pass, not at
        every one (TargetModel.weights_held)."""
        done = []
        with self.target.weights_held():
            while self.busy:
                finished = self.step()
                done += finished
                if on_finished is not None:
                    on_finished(finished)
        return done


def _keep_going(seq: Sequence):
    """What a sequence's proposer asks before drafting or reading further drafts (None: draft the whole block)."""
    if seq.controller.whole_blocks:
        return None
    if seq.proposer.one_pass:
        return seq.controller.could_verify_more
    return seq.controller.keep_growing if seq.proposer.tree_nodes else seq.controller.keep_going


class SpeculativeDecoder:
    """One sequence at a time through the engine's loop; lossless for every proposer (the target decides every
    token)."""

    def __init__(self, target, proposer: Proposer | None = None, adaptive: bool = True,
                 timer: Callable[[], float] = time.perf_counter, prefix_cache_bytes: int = 0):
        self.target = target
        self.proposer = proposer or Proposer()
        self.engine = Engine(target, self.proposer, max_batch=1, adaptive=adaptive, timer=timer,
                             prefix_cache_bytes=prefix_cache_bytes)

    def generate(
        self,
        prompt_ids: list[int],
        config: GenerationConfig | None = None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
    ) -> GenerationResult:
        """Generate after `prompt_ids`. `on_tokens(new_ids)` is called as tokens are committed; returning False
        cancels the generation (a streaming client went away)."""
        seq = self.engine.submit(prompt_ids, config, on_tokens)
        self.engine.run()
        return seq.result

    def budget(self, prompt_ids: list[int]) -> int:
        return self.engine.budget(prompt_ids)


def plain_greedy(seq: Sequence) -> bool:
    """Greedy without penalties or a grammar: the argmax of the raw logits, which the LM head's screen can find."""
    return screenable(seq) and seq.grammar is None


def screenable(seq: Sequence) -> bool:
    """Greedy without penalties from here on (min_tokens's once it is met): the screen's argmax (with a grammar,
    checked against its mask: _grammar_checked)."""
    return seq.config.sampling.greedy and not seq.config.sampling.penalized_after(len(seq.output))


def free_drafts(seq: Sequence) -> list[Draft]:
    """Drafts that cost no drafter pass: the proposer's lookup's (prompt lookup beside a drafter), the request's
    prediction's, and those the sequence's grammar forces (a key's name once its quote is open); none in whole-block
    mode."""
    if seq.controller.whole_blocks or seq.proposer.max_draft == 0:
        return []
    drafts = []
    if seq.proposer.lookup is not None:
        drafts.append(within_grammar(seq, seq.proposer.lookup.propose(seq.sequence, limit=seq.proposer.max_draft)))
    if seq.prediction is not None:
        drafts.append(within_grammar(seq, seq.prediction.propose(seq.output, seq.proposer.max_draft)))
    if seq.grammar is not None:
        forced = seq.grammar.forced(seq.output)[: seq.proposer.max_draft]
        if forced:
            drafts.append(Draft(forced, label=GRAMMAR_LABEL))
    return drafts


def within_grammar(seq: Sequence, draft: Draft) -> Draft:
    """A chain of drafts held to the sequence's grammar: where it refuses a draft the first of the drafter's
    runners-up there that it allows takes its place (Draft.alternatives), and the chain is cut before a position
    where it allows none. The target never picks a refused token, so verifying it, and the drafts after it, could
    only cost. The controller then chooses among the rest."""
    if seq.grammar is None or draft.parents is not None or not draft.tokens:
        return draft
    alternatives = draft.alternatives or [[] for _ in draft.tokens]
    candidates = [[token] + [t for t, _ in others] for token, others in zip(draft.tokens, alternatives)]
    chosen = seq.grammar.allowed_chain(seq.output, candidates)
    if chosen == [0] * len(draft.tokens):
        return draft
    tokens = [options[index] for options, index in zip(candidates, chosen)]
    confidence = None
    if draft.confidence is not None:
        confidence = [runner_up_confidence(p, others, index)
                      for p, others, index in zip(draft.confidence, alternatives, chosen)]
    return Draft(tokens, confidence, draft.label)


def runner_up_confidence(first: float, others: list[tuple[int, float]], index: int) -> float:
    """The drafter's probability of its candidate `index` at a position (0: its own draft, i: runner-up i) given
    that the grammar refused the candidates before it: renormalised over what they leave."""
    if index == 0:
        return first
    refused = first + sum(p for _, p in others[: index - 1])
    return min(1.0, others[index - 1][1] / max(1e-9, 1.0 - refused))


def grammar_masked(logits: torch.Tensor, seq: Sequence, past: list[int]) -> torch.Tensor:
    """`logits` of the position after the committed output and `past` (drafts), with the tokens the sequence's
    grammar refuses there at -inf."""
    allowed = seq.grammar.mask(seq.output, past)
    if allowed is seq.grammar.free_mask:  # free text (a reply that called no tool): nothing to mask
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def first_stop_string(text: str, stop_strings, floor: int = 0) -> tuple[int, int, str] | None:
    """(where it begins, where it ends, which) of `text`'s first stop string that ends past its first `floor`
    characters; None for none."""
    found = [(at, at + len(s), s) for s in stop_strings if s and (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    return min(found) if found else None


def stop_string_at(text: str, stop_strings, floor: int = 0, include: bool = False) -> int:
    """Where `text` is cut for its first stop string that ends past its first `floor` characters: where that
    begins, or with `include` where it ends (vLLM's include_stop_str_in_output); -1 for none."""
    found = first_stop_string(text, stop_strings, floor)
    return -1 if found is None else found[1] if include else found[0]


def stop_floor(decode, tokens: list[int], min_tokens: int) -> int | None:
    """The characters a stop string must end past: the text of the first min_tokens - 1 tokens, as vLLM checks stop
    strings from the min_tokens-th token on (an earlier one never ends the output); None while fewer than
    min_tokens tokens are written."""
    if len(tokens) < min_tokens:
        return None
    return len(decode(tokens[: min_tokens - 1])) if min_tokens > 1 else 0
