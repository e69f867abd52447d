"""How many drafts to verify each round: the choice that maximises tokens per second on THIS machine.

Per round, with R the sequence's recent throughput (tokens/s) and T(w) the measured time of a target pass of w
tokens per row, verifying k drafts is worth

    E_k - R * (T(k + 1) - T(1)),    E_k = sum_{j<=k} P(drafts 1..j all accepted)

tokens over a plain decode step: its expected accepted drafts minus what the extra verify time would have produced
at the current rate (the reward-rate rule: a choice pays when it beats the rate it runs at). P comes from the
drafter's own confidence in each draft, calibrated online against what the target accepted (`Calibration`); T from
timing the passes (`CostModel`). k = 0 is a plain decode step. Drafting itself costs time too: when the value the
chosen drafts were expected to bring in recent rounds (an average, so one unlucky round does not decide) no longer
covers R * (drafting time), the drafter is skipped, and tried again after a growing number of rounds in case the
text turned predictable. A drafter may come with a free *lookup* (prompt lookup: `dflash+ngram`): its drafts cost
no drafting, have a calibration of their own (by position and match length), and a round takes whichever is worth
more, the lookup's drafts or running the drafter (whose value is the recent rounds' average, net of its drafting
time). Lossless whatever it chooses: the target decides every token.

In a batch every row waits for one pass as wide as its widest block, so the engine takes the number of drafts a row
verifies for the batch as a whole (`batch_width`): the width w whose expected accepted drafts, summed over the rows
(each verifying min(w, its drafts)), most exceed what the wider pass costs at the batch's rate.

Every time comes from an injectable `timer`, so tests are deterministic.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

CONFIDENCE_BINS = 10
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the drafter's own confidence before the calibration learns
SMOOTHING = 0.15  # EMA weight of a new observation (rate, gain, draft time, the machine's speed)
SHAPE_SMOOTHING = 0.02  # how fast a pass width's cost relative to the machine's speed moves
CHAINED_PRIOR = True  # a draft position's prior is the estimate of the position before it (Calibration); False: 0.5
GAIN_SMOOTHING = 0.3  # the value of drafting moves with the text: a probe that finds a predictable stretch counts
PROBE_FIRST, PROBE_MAX = 4, 64  # rounds without drafting before the next probe, doubling while it does not pay ...
PROBE_BUDGET = 0.015  # ... but never so far apart that a cheap drafter's probes would cost more than this much time
# (3% let the shipped drafter's probes cost dflash ~5% on MT-Bench, where they almost never paid: 0.94x of ar)


class Calibration:
    """P(draft accepted | every draft before it was) by the drafter's confidence (binned), or by draft position
    for drafters without one (ngram), kept apart by the draft's label where it has one (prompt lookup: the length of
    its match, 0 for the target's continuation table; in HumanEval a 3-token match's drafts were accepted 79% of the
    time, a 1-token match's 8%). Starts from the confidence itself, or by position from 0.5 at the first and, at
    each later one, from what the position before it has learnt, and learns from every round. Why the chain: a
    position is only observed where a round verified that deep, so at a flat 0.5 a later position that no round
    had reached kept every round at one draft (a repetitive 2750-token prompt: the first draft accepted 93% of the
    time, tau 1.75, each later draft priced at 0.5; RESULTS.md, thirty-fifth session)."""

    def __init__(self, positions: int):
        self.positions = positions
        self.tried = [0.0] * CONFIDENCE_BINS
        self.accepted = [0.0] * CONFIDENCE_BINS
        self.by_label: dict[int | None, tuple[list[float], list[float]]] = {}  # label -> (tried, accepted) by position
        self.by_confidence: bool | None = None  # whether the drafts verified so far came with confidences
        self.position_tried, self.position_accepted = self._positions(None)
        self._chained: dict[int | None, list[float]] = {}  # label -> probability by position, until the next round

    def _positions(self, label: int | None) -> tuple[list[float], list[float]]:
        if label not in self.by_label:
            self.by_label[label] = ([0.0] * self.positions, [0.0] * self.positions)
        return self.by_label[label]

    def _by_position(self, label: int | None) -> list[float]:
        """Each position's probability, its prior the estimate of the position before it (0.5 at the first)."""
        if label not in self._chained:
            tried, accepted = self._positions(label)
            chained, prior = [], 0.5
            for t, a in zip(tried, accepted):
                estimate = (a + prior * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)
                chained.append(estimate)
                prior = estimate if CHAINED_PRIOR else 0.5
            self._chained[label] = chained
        return self._chained[label]

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(CONFIDENCE_BINS - 1, max(0, int(confidence * CONFIDENCE_BINS)))

    def counts(self, label: int | None) -> tuple[list[float], list[float]]:
        """(tried, accepted) by position for the drafts of `label`, as copies."""
        tried, accepted = self._positions(label)
        return list(tried), list(accepted)

    def set_counts(self, label: int | None, tried: list[float], accepted: list[float]) -> None:
        """Put (tried, accepted) by position in place for the drafts of `label` (a prior carried in)."""
        self.by_label[label] = (list(tried), list(accepted))
        self._chained.pop(label, None)

    def probability(self, position: int, confidence: float | None, label: int | None = None) -> float:
        if confidence is None:
            return self._by_position(label)[position]
        b = self._bin(confidence)
        return (self.accepted[b] + confidence * PRIOR_WEIGHT) / (self.tried[b] + PRIOR_WEIGHT)

    def highest_probability(self) -> float:
        """The most `probability` gives any confidence: each bin's at the top of its range (it grows with the
        confidence inside a bin)."""
        tops = (min(1.0, (b + 1) / CONFIDENCE_BINS) for b in range(CONFIDENCE_BINS))
        return max((self.accepted[b] + top * PRIOR_WEIGHT) / (self.tried[b] + PRIOR_WEIGHT)
                   for b, top in enumerate(tops))

    def best(self) -> float:
        """The most `probability` gives any draft (1.0 before a draft was verified): a bound on every draft's
        chance, by confidence or by position, whichever this calibration has learnt."""
        if self.by_confidence is None:
            return 1.0
        if self.by_confidence:
            return self.highest_probability()
        return max(max(self._by_position(label)) for label in list(self.by_label))

    def observe(self, confidences: list[float] | None, verified: int, accepted: int, label: int | None = None) -> None:
        """`verified` drafts went to the target and the first `accepted` of them were accepted: each draft up to
        the first rejection counts as a trial (later ones were never reached)."""
        if verified > 0:
            self.by_confidence = confidences is not None
        self._chained.pop(label, None)
        tried, hits = self._positions(label) if confidences is None else (None, None)
        for j in range(min(verified, accepted + 1)):
            hit = 1.0 if j < accepted else 0.0
            if confidences is None:
                tried[j] += 1
                hits[j] += hit
            else:
                b = self._bin(confidences[j])
                self.tried[b] += 1
                self.accepted[b] += hit


class TreeCalibration:
    """P(a tree node's whole path is accepted) by the drafter's probability of that path (trees.py: the product
    of its tokens' probabilities), in bins of halving probability: a tree's nodes range from near-certain first
    drafts to deep paths of a few percent, where a chain's ten linear bins would lump everything under 0.1
    together. Starts from the probability itself and learns from every tree round: each verified node is a trial,
    a hit where it lies on the accepted path."""

    BINS = 12  # the last one holds every path below 2^-11

    def __init__(self):
        self.tried = [0.0] * self.BINS
        self.accepted = [0.0] * self.BINS

    def _bin(self, probability: float) -> int:
        return self.BINS - 1 if probability <= 0 else min(self.BINS - 1, max(0, int(-math.log2(probability))))

    def probability(self, path_probability: float) -> float:
        b = self._bin(path_probability)
        return (self.accepted[b] + path_probability * PRIOR_WEIGHT) / (self.tried[b] + PRIOR_WEIGHT)

    def observe(self, path_probabilities: list[float], accepted_nodes: set[int]) -> None:
        """`path_probabilities` of the verified drafts (draft i is the tree's node i + 1); `accepted_nodes`: the
        nodes of the accepted path, the root excluded."""
        for i, p in enumerate(path_probabilities):
            b = self._bin(p)
            self.tried[b] += 1
            self.accepted[b] += (i + 1) in accepted_nodes

    def chances(self, path_probabilities: list[float]) -> list[float]:
        """The tree's nodes, in best-first order, as a chain's chances (P(draft j accepted | the ones before it
        were)): c_j = Q_j / Q_{j-1} of the calibrated path probabilities Q, so a chain's expected accepted count
        over the first k, the sum of the chances' running products, is the tree's: the sum of Q_1..Q_k, each node
        adding the chance that its path is accepted. The controller then prices k nodes as it prices k drafts."""
        out, before = [], 1.0
        for p in path_probabilities:
            q = self.probability(p)
            out.append(q / before if before > 0 else 0.0)
            before = q
        return out


class CostModel:
    """Seconds a target pass takes by the tokens it verifies (rows x width), learned from the passes themselves.

    Two parts, so that a reading taken while the machine was busy cannot freeze a wrong comparison: `level`, how
    slow the machine is right now, which every pass updates, and per token count the pass's cost relative to that
    level, which only passes of that count update, and slowly. A count that has not been chosen for a while (a
    plain step while whole blocks pay, or the reverse) follows the machine's level instead of keeping the absolute
    time of the busy moment it was last measured in; with one absolute EMA per count a single slow plain step could
    make every wide pass look free, for good. Linear between measured counts, the nearest slope beyond them.

    A wide pass's share of attention grows with the context its tokens attend to: measured after 64 and 512
    tokens, a 4-token bfloat16 pass cost 1.13x and 1.30x a step, a 16-token one 1.70x and 2.32x (2 Zen 4 cores). So
    where the costs were measured at several contexts (`seed`), each width's relative cost moves linearly with the
    context a pass is at (`growth_by_width`); its shape learnt online corrects the value at the reference context."""

    def __init__(self):
        self.level: float | None = None  # seconds of a pass of relative cost 1
        self.relative: dict[int, float] = {}  # width -> relative cost, at the reference context
        self.growth: dict[int, float] = {}  # width -> relative cost added per token of context (seeded)
        self.reference = 0  # the context `relative` is at
        self.drafting: float | None = None  # seconds one sequence's drafting adds to a round, in steady state
        # context -> (the widths in order, the largest relative cost up to each): every row of a batch prices
        # several widths each round, and recomputing the maximum over narrower widths per price was 3% of a round
        self._envelopes: dict[int | None, tuple[list[int], list[float]]] = {}

    def observe_drafting(self, seconds: float) -> None:
        """One round's drafting time per sequence. Only rounds whose drafter caught up on a few context tokens count:
        the first round of a sequence also reads its whole prompt (100+ ms on CPU, 20x a steady round), and
        an estimate that remembered it would keep the drafter switched off for dozens of rounds."""
        self.drafting = _ema(self.drafting, seconds)

    def observe_round(self, width: int, seconds: float, context: int | None, drafting: float | None) -> None:
        """A batch's round, read once: its pass of `width` tokens in all, and (where it counts, see
        `observe_drafting`) what each drafting row's share of the drafting took. Read row by row, 16 rows moved
        the machine's level 16 times toward each pass (93% of the way), so one noisy pass set every price."""
        self.observe(width, seconds, context)
        if drafting is not None:
            self.observe_drafting(drafting)

    def seed(self, relative: dict[int, float], context: int = 0,
             longer: dict[int, dict[int, float]] | None = None) -> None:
        """Start from pass costs measured at load after `context` tokens, relative to a 1-token pass
        (`measured_pass_costs`): learnt online alone, a width first seen at a quiet moment kept looking cheaper than
        a plain step for hundreds of rounds, and the controller verified 4-7 drafts a round where one paid (0.88x on
        MATH-500). `longer`: {a longer context: the relative costs measured after it}, for their growth
        (`growth_by_width`)."""
        self.relative, self.reference = dict(relative), context
        self._envelopes.clear()
        if longer:
            self.growth = growth_by_width({context: relative, **longer})

    def seed_batches(self, tokens: int) -> None:
        """Price the passes of a batch wider than any measured width, up to `tokens`, in proportion to their tokens:
        past 16 tokens a pass is bound by its arithmetic (float32, 2 cores: 16 rows x 2, 3, 4, 5 tokens took 1.8,
        2.6, 3.3, 4.1 times 16 rows x 1), where the slope between the widths measured for one row priced 16 x 4 at
        half of that, and every row of a batch of 16 verified drafts that cost more than they brought."""
        if not self.relative:
            return
        widest = max(self.relative)
        width = 2 * widest
        while width <= max(tokens, 2 * widest):
            self.relative[width] = self.relative[widest] * width / widest
            width *= 2
        self._envelopes.clear()

    def observe(self, width: int, seconds: float, context: int | None = None) -> None:
        self._learn(width, seconds, context)
        self._envelopes.clear()  # every reading may move a relative cost

    def _learn(self, width: int, seconds: float, context: int | None) -> None:
        if self.level is None:  # the first reading sets the machine's level; seeded shapes stay as measured
            if not self.relative:
                self.relative[width] = 1.0
            self.level = seconds / max(self._relative(width, context), 1e-12)
            return
        if width not in self.relative:
            self.relative[width] = seconds / self.level - self._growth(width, context)
            return
        # clipped: one reading from a moment when another job held the cores moves the estimates a bounded step
        surprise = min(1.0, max(-0.5, seconds / max(self.cost(width, context), 1e-12) - 1))
        self.level *= 1 + SMOOTHING * surprise
        self.relative[width] *= 1 + SHAPE_SMOOTHING * surprise

    @property
    def known(self) -> bool:
        return self.level is not None

    def cost(self, width: int, context: int | None = None) -> float:
        """Seconds of a pass of `width` tokens after `context` tokens (None: at the reference context)."""
        if self.level is None:
            return 0.0
        return self.level * self._relative(width, context)

    def relative_cost(self, width: int, context: int | None = None) -> float:
        """A pass of `width` tokens in units of a 1-token pass (1.0 before anything is known)."""
        return self._relative(width, context) if self.relative else 1.0

    def _relative(self, width: int, context: int | None = None) -> float:
        """Never below a narrower pass's: a wider pass reads the same weights and does more work, so a reading
        that says otherwise is noise, and believing it would make extra drafts look free."""
        widths, peaks = self._envelope(context)
        narrower = bisect.bisect_left(widths, width)
        value = self._at(width, context)
        return max(value, peaks[narrower - 1]) if narrower else value

    def _envelope(self, context: int | None) -> tuple[list[int], list[float]]:
        if len(self._envelopes) > 64:  # many contexts between two passes: only the current ones are priced again
            self._envelopes.clear()
        if context not in self._envelopes:
            widths = sorted(self.relative)
            self._envelopes[context] = widths, list(itertools.accumulate((self._at(w, context) for w in widths), max))
        return self._envelopes[context]

    def _at(self, width: int, context: int | None) -> float:
        return _pass_cost(self.relative, width) + self._growth(width, context)

    def _growth(self, width: int, context: int | None) -> float:
        if context is None or not self.growth:
            return 0.0
        return max(0.0, _interpolated(self.growth, width)) * (context - self.reference)


def nondecreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pooling adjacent violators): a wider pass costs at
    least a narrower one, so a reading that says otherwise is noise, spread over its neighbours rather than raised
    to the dearest of them."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, n), (b, m) = blocks.pop(-2), blocks.pop()
            blocks.append([(a * n + b * m) / (n + m), n + m])
    return [mean for mean, count in blocks for _ in range(count)]


def growth_by_width(by_context: dict[int, dict[int, float]]) -> dict[int, float]:
    """Each width's relative cost added per token of context: the least-squares slope over the contexts measured,
    then made non-decreasing in width (a wider pass's attention grows at least as fast) and never negative. A slope
    from two nearby contexts is mostly noise: fitted to 64 and 512 tokens, a 2-token pass's grew faster than an
    8-token one's and priced it at 1.96x a step after 2750 tokens (1.10x measured)."""
    contexts = sorted(by_context)
    widths = sorted(set.intersection(*(set(by_context[c]) for c in contexts)))
    mean_c = sum(contexts) / len(contexts)
    spread = sum((c - mean_c) ** 2 for c in contexts)
    slopes = []
    for w in widths:
        mean_r = sum(by_context[c][w] for c in contexts) / len(contexts)
        slopes.append(sum((c - mean_c) * (by_context[c][w] - mean_r) for c in contexts) / spread)
    return {w: max(0.0, g) for w, g in zip(widths, nondecreasing(slopes))}


def _pass_cost(relative: dict[int, float], width: int) -> float:
    """A pass's relative cost (_interpolated), never below the narrowest known pass's scaled by its tokens. Read
    first at a batch's width, a single width's 5%-a-token slope had priced a 1-token step at -0.55 (32 tokens seen),
    and the thread chooser divided by the 0 the envelope made of it (`dflash bench --batch` on a tiny target)."""
    narrowest = min(relative)
    return max(relative[narrowest] * min(1.0, width / narrowest), _interpolated(relative, width))


def _interpolated(values: dict[int, float], width: int) -> float:
    """values[width], linear between the widths it has, the nearest slope beyond them (one width: 5% a token)."""
    if width in values:
        return values[width]
    widths = sorted(values)
    at = bisect.bisect(widths, width)  # widths[:at] are below `width`, the rest above
    if 0 < at < len(widths):
        a, b = widths[at - 1], widths[at]
        return values[a] + (values[b] - values[a]) * (width - a) / (b - a)
    if len(widths) == 1:  # one width seen: assume what a CPU verify costs per extra token, 5% of a step
        return values[widths[0]] * (1 + 0.05 * (width - widths[0]))
    a, b = (widths[-2], widths[-1]) if at == len(widths) else (widths[0], widths[1])
    edge = widths[-1] if at == len(widths) else widths[0]
    slope = max(0.0, (values[b] - values[a]) / (b - a))
    return max(0.0, values[edge] + slope * (width - edge))


@dataclass
class ControllerStats:
    chosen: dict[int, int] = field(default_factory=dict)  # drafts verified -> rounds
    skipped_drafting: int = 0  # rounds that did not run the drafter at all

    def histogram(self, max_draft: int) -> list[int]:
        return [self.chosen.get(k, 0) for k in range(max_draft + 1)]


class DraftController:
    """Chooses, per round, whether to draft and how many drafts to verify (see the module docstring). One per
    sequence; `whole_blocks` always drafts and verifies every draft (the paper's setting)."""

    def __init__(self, max_draft: int, costs: CostModel, whole_blocks: bool = False,
                 timer: Callable[[], float] = time.perf_counter, calibration: Calibration | None = None,
                 lookup_calibration: Calibration | None = None, tree_calibration: TreeCalibration | None = None):
        """`calibration`: shared with the other sequences of an engine (how far the drafter's confidence can be
        trusted is the drafter's, not the text's), so a new sequence does not start from the raw confidence;
        `lookup_calibration` likewise for the drafts of a free lookup, where the drafter has one, and
        `tree_calibration` for a drafter's trees."""
        self.max_draft, self.costs, self.whole_blocks, self.timer = max_draft, costs, whole_blocks, timer
        self.calibration = calibration if calibration is not None else Calibration(max(1, max_draft))
        self.tree_calibration = tree_calibration if tree_calibration is not None else TreeCalibration()
        self.lookup_calibration = lookup_calibration if lookup_calibration is not None else Calibration(
            max(1, max_draft))
        self.rate: float | None = None  # tokens/s of this sequence's recent rounds
        self.gain: float | None = None  # expected tokens drafted rounds bring beyond plain steps, net of verify time
        self.chosen_value: float | None = None  # the expected value of this round's choice (None: not modelled)
        self.skips_left, self.probe_gap, self.probe_due = 0, PROBE_FIRST, False
        self.rows = 1  # sequences in the current batch: each extra draft widens a pass of that many rows
        self.context: int | None = None  # tokens the sequence's next pass attends to (set by the engine each round)
        self.stats = ControllerStats()

    def _extra_cost(self, width: int) -> float:
        """Seconds a pass `width` tokens wide per row costs beyond a plain step (width 1), at the current batch."""
        return self.costs.cost(self.rows * width, self.context) - self.costs.cost(self.rows, self.context)

    # ---- before drafting ----------------------------------------------------------------------------------------
    def lookup_choice(self, available: int, label: int | None = None) -> tuple[int, float]:
        """(how many of `available` free lookup drafts to verify, the expected value of that), by the lookup's own
        calibration (for drafts of its `label`); (0, 0.0) in whole-block mode and before the costs are known."""
        if available <= 0 or self.whole_blocks or not self.costs.known or self._widening_cannot_pay():
            return 0, 0.0  # the last: in a batch bound by its arithmetic, pricing every draft was 5% of a round
        return self._best(self.acceptance(available, None, label, lookup=True))

    def should_draft(self, alternative: float = 0.0) -> bool:
        """Draft unless recent drafted rounds did not pay for the drafting (then skip, and probe now and then), or
        this round has an `alternative` (a free lookup's expected value) worth more than drafting is."""
        if self.whole_blocks or self.max_draft == 0:
            return self.max_draft > 0
        if self.skips_left > 0:
            self.skips_left -= 1
            self.stats.skipped_drafting += 1
            self.probe_due = self.skips_left == 0
            return False
        if self.no_draft_can_pay() or (self.costs.relative and not self.costs.known):
            # with measured pass costs but no level yet, a first plain step measures the machine's level: drafting
            # unmodelled verified every draft (in a batch of 16 rows, 16 x 16 tokens, 13 plain steps' time)
            self.stats.skipped_drafting += 1
            return False
        draft_seconds = self.costs.drafting
        if self.probe_due or self.gain is None or self.rate is None or draft_seconds is None:
            self.probe_due = False  # a probe: one drafted round refreshes `gain`
            return True
        # drafting delays every row of the batch, not only this one
        if self.gain > self.rows * self.rate * draft_seconds:
            self.probe_gap = PROBE_FIRST
            if self.gain - alternative > self.rows * self.rate * draft_seconds:
                return True
            self.stats.skipped_drafting += 1  # the lookup is worth more this round: no skipping streak
            return False
        # not paying: skip a while, then probe again (a probe refreshes `gain` with one drafted round)
        self.skips_left, self.probe_gap = self.probe_gap - 1, min(self._widest_probe_gap(), 2 * self.probe_gap)
        self.stats.skipped_drafting += 1
        return False

    def no_draft_can_pay(self) -> bool:
        """Whether drafts in every row of the batch, one or a whole block, each as likely to be accepted as the
        calibration lets any draft be (`Calibration.best`; certain for a row alone), would still cost more than
        they bring: the wider pass and the drafting, both of which every row waits for. Where a batch's passes are
        bound by their arithmetic, one more token a row costs most of a step (16 rows in float32) and the
        drafter's pass for 16 rows half a step more, so drafting, and probing whether it pays, only costs (in the
        load test `dflash+ngram` ran the drafter for rows that never verified a draft)."""
        if not self.costs.known:
            return False
        self._start_rate()
        drafting = self.rows * (self.costs.drafting or 0.0)
        # a row alone keeps the bound of certain drafts: its probes are what refresh a calibration that a bad
        # stretch of text had made too pessimistic (a batch's rows probe again whenever a row runs alone)
        best = self.calibration.best() if self.rows > 1 else 1.0
        return all(self.rate * (self._extra_cost(k + 1) + drafting) >= sum(best ** j for j in range(1, k + 1))
                   for k in {1, max(1, self.max_draft)})

    def _widening_cannot_pay(self) -> bool:
        """Whether a certain draft in every row brings less than the wider pass costs (a free lookup's drafts)."""
        if not self.costs.known:
            return False
        self._start_rate()
        return self.rate * self._extra_cost(2) >= 1.0

    def _widest_probe_gap(self) -> int:
        """Rounds between probes at which probing costs PROBE_BUDGET of the time: a probe that costs a tenth of a
        step may come every few rounds (it finds predictable stretches early), one that costs a whole step rarely.
        A probe costs its drafting and the wider pass that verifies at least one draft. The rows of a batch share
        the budget, each probing `rows` times as rarely: they probe each on its own count, every probe holds up
        the whole batch, and a lone row's drafting pass costs most of what the batch's would."""
        step = self.costs.cost(self.rows, self.context)
        if step <= 0 or self.costs.drafting is None:
            return PROBE_MAX * self.rows
        probe = self.costs.drafting + self._extra_cost(2)
        return max(PROBE_FIRST, min(PROBE_MAX * self.rows, math.ceil(self.rows * probe / (PROBE_BUDGET * step))))

    # ---- after drafting -----------------------------------------------------------------------------------------
    def choose(self, confidences: list[float] | None, available: int, label: int | None = None,
               tree: bool = False) -> int:
        """How many of the `available` drafts to verify (`label`: the drafts', see Calibration; `tree`: they are
        a tree's nodes in best-first order, their confidences the paths' probabilities, and the first k of them a
        tree too)."""
        self.chosen_value = None
        if self.whole_blocks or not self.costs.known:
            return available
        self._start_rate()
        best_k, self.chosen_value = self._best(self.acceptance(available, confidences, label, tree=tree))
        return best_k

    def acceptance(self, draft_count: int, confidences: list[float] | None, label: int | None = None,
                   lookup: bool = False, tree: bool = False) -> list[float]:
        """P(draft j accepted | every draft before it was), j < draft_count, for the drafter's drafts or (`lookup`)
        the free lookup's; for a tree's nodes, their chain-equivalent chances (TreeCalibration.chances)."""
        if tree:
            return self.tree_calibration.chances(confidences[:draft_count])
        if lookup:
            return [self.lookup_calibration.probability(j, None, label) for j in range(draft_count)]
        return [self.calibration.probability(j, confidences[j] if confidences else None, label)
                for j in range(draft_count)]

    def _start_rate(self) -> None:
        if self.rate is None:  # a new sequence: until its own rounds say otherwise, the rate of plain steps
            self.rate = 1 / max(self.costs.cost(self.rows, self.context), 1e-9)

    def _best(self, probabilities: list[float]) -> tuple[int, float]:
        """(k, value) of the most valuable number of drafts to verify; (0, 0.0): none pays."""
        best_k, best_value = 0, 0.0
        for k, value in self._values(probabilities):
            if value > best_value:
                best_k, best_value = k, value
        return best_k, best_value

    def could_verify_more(self, confidences: list[float]) -> bool:
        """For a drafter that makes every draft in one pass but reads them in steps (DFlash's LM head): could
        `choose` verify a draft beyond these, whatever the unread ones' confidences? Each later choice's value is
        bounded by taking every unread draft to be accepted with the highest probability the calibration gives
        any confidence. False only where no bound beats the best choice among the drafts read, so reading no
        further leaves the choice as it would have been."""
        if self.whole_blocks or self.rate is None or not self.costs.known:
            return True
        read = len(confidences)
        if read >= self.max_draft:
            return False
        probabilities = [self.calibration.probability(j, c) for j, c in enumerate(confidences)]
        probabilities += [self.calibration.highest_probability()] * (self.max_draft - read)
        best = 0.0
        for k, value in self._values(probabilities):
            if k <= read:
                best = max(best, value)
            elif value > best:
                return True
        return False

    def _values(self, probabilities: list[float]):
        """(k, the value of verifying k drafts) for k = 1.. len(probabilities), from each draft's probability of
        being accepted given every one before it was."""
        expected, all_right = 0.0, 1.0
        rate, step = self.rate, self.costs.cost(self.rows, self.context)
        for k, p in enumerate(probabilities, start=1):
            all_right *= p
            expected += all_right
            yield k, expected - rate * (self.costs.cost(self.rows * (k + 1), self.context) - step)

    def keep_going(self, confidences: list[float]) -> bool:
        """For chain drafters (EAGLE-3), after each draft: is one more worth its drafting step? Only if even a
        certain next draft (probability 1 times the chain so far) beats the time of drafting and verifying it."""
        if self.whole_blocks or self.rate is None or not self.costs.known or self.costs.drafting is None:
            return True
        k = len(confidences)
        chain = 1.0
        for j, c in enumerate(confidences):
            chain *= self.calibration.probability(j, c)
        step = self.costs.drafting / max(1, self.max_draft)
        return chain > self.rate * (step + self._extra_cost(k + 2) - self._extra_cost(k + 1))

    def keep_growing(self, best_path: float, depth: int) -> bool:
        """For drafters that grow a tree depth by depth (EAGLE-3's dynamic tree): is another depth worth its
        drafting step? Its nodes' paths are no likelier than the likeliest leaf's, `best_path` (the drafter's
        probability), so only if that leaf's calibrated chance beats the time of a depth's drafting and of one more
        token verified `depth` deep."""
        if self.whole_blocks or self.rate is None or not self.costs.known or self.costs.drafting is None:
            return True
        step = self.costs.drafting / max(1, self.max_draft)
        chance = self.tree_calibration.probability(best_path)
        return chance > self.rate * (step + self._extra_cost(depth + 2) - self._extra_cost(depth + 1))

    # ---- after verifying ----------------------------------------------------------------------------------------
    def record(self, drafted: bool, confidences: list[float] | None, verified: int, accepted: int,
               draft_seconds: float, verify_seconds: float, width: int | None = None,
               catching_up: bool = False, lookup: bool = False, label: int | None = None,
               costs_read: bool = False, accepted_nodes: list[int] | None = None) -> None:
        """One round's outcome: `verified` drafts checked, `accepted` of them taken; the pass verified `width`
        tokens in all (rows x its widest block; default: this row's block alone). `catching_up`: the drafting
        also read a long backlog of context (a prompt), so its time says nothing about a steady round's.
        `lookup`: the verified drafts were the free lookup's (`drafted`: the drafter ran all the same); `label`:
        theirs (see Calibration). `costs_read`: the pass's and the drafting's times are in the shared cost model
        already (`observe_round`: a batch's rows share one pass). `accepted_nodes`: the drafts were a tree's, and
        these nodes (block indices) made the accepted path."""
        self.stats.chosen[verified] = self.stats.chosen.get(verified, 0) + 1
        if not costs_read:
            self.costs.observe(width or verified + 1, verify_seconds, self.context)
        seconds = draft_seconds + verify_seconds
        if seconds > 0:
            rate = (accepted + 1) / seconds
            self.rate = rate if self.rate is None else self.rate + SMOOTHING * (rate - self.rate)
        if lookup:
            self.lookup_calibration.observe(None, verified, accepted, label)
        if not drafted:
            return
        if not catching_up and not costs_read:
            self.costs.observe_drafting(draft_seconds)
        if accepted_nodes is not None:
            self.tree_calibration.observe(confidences[:verified], set(accepted_nodes))
        elif not lookup:
            self.calibration.observe(confidences, verified, accepted, label)
        if self.chosen_value is not None:  # the model's expectation: far steadier than one round's luck (rounds
            # before the costs were known verified whole blocks unmodelled: they say nothing about the value)
            self.gain = _ema(self.gain, self.chosen_value, GAIN_SMOOTHING)


def expected_accepted(probabilities: list[float]) -> list[float]:
    """[E_0, E_1, ...]: the expected number of accepted drafts when the first k are verified (see the top)."""
    sums, all_right = [0.0], 1.0
    for p in probabilities:
        all_right *= p
        sums.append(sums[-1] + all_right)
    return sums


def batch_width(acceptances: list[list[float]], costs: CostModel, rate: float,
                context: int | None = None) -> tuple[int, float]:
    """(w, value) for a batch whose rows are verified in one pass as wide as its widest row: each row verifies
    min(w, its drafts) drafts, and w maximises the batch's expected accepted drafts minus the tokens the wider pass
    costs at `rate` (tokens/s of the whole batch, every row waits for the pass); (0, 0.0): a plain step. Row by
    row, each row had to pay for widening every row's pass alone: 8 float32 rows never verified a draft, where a
    draft in each row pays once the batch's first drafts are half likely to be accepted (8 x 2 tokens cost 1.5
    steps)."""
    rows = len(acceptances)
    expected = [expected_accepted(a) for a in acceptances]
    step = costs.cost(rows, context)
    best_w, best_value = 0, 0.0
    for w in range(1, max(map(len, acceptances), default=0) + 1):
        gain = sum(e[min(w, len(e) - 1)] for e in expected)
        value = gain - rate * (costs.cost(rows * (w + 1), context) - step)
        if value > best_value:
            best_w, best_value = w, value
    return best_w, best_value


def _ema(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else old + weight * (new - old)
