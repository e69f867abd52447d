"""The adaptive draft controller: lossless at every length it may choose, deterministic under a fixed clock, and
choosing what the measured costs and the calibrated confidences say."""

import math
import random

import pytest

from conftest import ARCHS, OracleProposer, OracleTree, RandomProposer
from dflash.control import Calibration, CostModel, DraftController, _interpolated, batch_width
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.methods.base import Draft
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.ngram import NgramProposer
from test_engine import make_drafter

PROMPTS = ["w1 w2 w3 w4 w5", "w7 w7 w7", "w20 w31 w9 w9 w40 w12 w3"]
CONFIG = GenerationConfig(max_new_tokens=40, ignore_eos=True)


class FakeClock:
    """Time that moves only when the engine works: a target pass costs base + per_token * tokens, a draft
    `draft` seconds. The same run twice reads the same times."""

    def __init__(self, base=0.030, per_token=0.002, draft=0.005):
        self.now, self.base, self.per_token, self.draft = 0.0, base, per_token, draft

    def __call__(self) -> float:
        return self.now

    def install(self, monkeypatch, target, proposer):
        forward, propose = target.forward, proposer.propose

        def timed_forward(input_ids, *args, **kwargs):
            self.now += self.base + self.per_token * input_ids.numel()
            return forward(input_ids, *args, **kwargs)

        def timed_propose(*args, **kwargs):
            self.now += self.draft
            return propose(*args, **kwargs)

        monkeypatch.setattr(target, "forward", timed_forward)
        monkeypatch.setattr(proposer, "propose", timed_propose)


class RandomlySure(RandomProposer):
    """Random drafts (almost never right), each given the same confidence `sure`."""

    def __init__(self, vocab_size: int, max_draft: int, sure: float):
        super().__init__(vocab_size, max_draft)
        self.sure = sure

    def propose(self, sequence, limit=None, keep_going=None):
        draft = super().propose(sequence, limit)
        return Draft(draft.tokens, [self.sure] * len(draft.tokens))


class SureOracle(OracleProposer):
    """Always right (the target's own continuation), each draft given the confidence `sure`."""

    def __init__(self, reference: list[int], prompt_len: int, max_draft: int, sure: float):
        super().__init__(reference, prompt_len, max_draft)
        self.sure = sure

    def propose(self, sequence, limit=None, keep_going=None):
        draft = super().propose(sequence, limit)
        return Draft(draft.tokens, [self.sure] * len(draft.tokens))


def ar_tokens(target, ids):
    return SpeculativeDecoder(target).generate(ids, CONFIG).tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_at_every_chosen_length(tiny_targets, arch, monkeypatch):
    """Forced 0 (plain steps), forced block - 1 (whole blocks) and random lengths all give ar's tokens, for
    chains and for trees (whose first k nodes are a tree)."""
    target = tiny_targets[arch]
    rng = random.Random(0)
    forced = {"zero": lambda self, conf, available, *_, **__: 0,
              "all": lambda self, conf, available, *_, **__: available,
              "random": lambda self, conf, available, *_, **__: rng.randint(0, available)}
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt)
        reference = ar_tokens(target, ids)
        proposers = [DFlashProposer(make_drafter(target, 8), target), NgramProposer(max_draft=7),
                     RandomProposer(target.vocab_size, 7), OracleProposer(reference, len(ids), 7),
                     OracleTree(reference, len(ids), 12, target.vocab_size)]
        for name, choose in forced.items():
            monkeypatch.setattr(DraftController, "choose", choose)
            for proposer in proposers:
                result = SpeculativeDecoder(target, proposer).generate(ids, CONFIG)
                assert result.tokens == reference, f"{name} / {proposer.name}"
                lengths = set(result.stats.draft_lengths)
                if name == "zero":
                    assert lengths == {0}
        monkeypatch.undo()


def test_deterministic_under_a_fixed_clock(tiny_targets, monkeypatch):
    target = tiny_targets["qwen3"]
    ids = target.encode_prompt(PROMPTS[2])
    reference = ar_tokens(target, ids)

    def run():
        proposer = OracleProposer(reference, len(ids), 7)
        clock = FakeClock()
        with monkeypatch.context() as m:
            clock.install(m, target, proposer)
            result = SpeculativeDecoder(target, proposer, timer=clock).generate(ids, CONFIG)
        return result.stats.draft_lengths, result.stats.accept_lengths

    first, second = run(), run()
    assert first == second


def generate_under(target, ids, proposer, clock, monkeypatch):
    with monkeypatch.context() as m:
        clock.install(m, target, proposer)
        return SpeculativeDecoder(target, proposer, timer=clock).generate(ids, CONFIG)


def draft_lengths_under(target, ids, proposer, clock, monkeypatch) -> list[int]:
    return generate_under(target, ids, proposer, clock, monkeypatch).stats.draft_lengths


def test_costly_verify_means_shorter_drafts(tiny_targets, monkeypatch):
    """An always-right drafter that is only 60% sure: cheap verify tokens -> long blocks, dear ones -> short."""
    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[0])
    reference = ar_tokens(target, ids)
    cheap = draft_lengths_under(target, ids, SureOracle(reference, len(ids), 7, 0.6), FakeClock(per_token=0.0001),
                                monkeypatch)
    dear = draft_lengths_under(target, ids, SureOracle(reference, len(ids), 7, 0.6), FakeClock(per_token=0.02),
                               monkeypatch)
    assert sum(cheap[2:]) / len(cheap[2:]) > sum(dear[2:]) / len(dear[2:])
    assert max(dear[2:]) < 7


def test_useless_drafter_is_skipped_and_probed_again(tiny_targets, monkeypatch):
    """Random drafts are never accepted and drafting costs a lot: the controller stops drafting most rounds, but
    keeps probing (it never stops for good), and the output is still ar's."""
    target = tiny_targets["gemma3"]
    ids = target.encode_prompt(PROMPTS[1])
    proposer = RandomProposer(target.vocab_size, 7)
    clock = FakeClock(draft=0.05)
    with monkeypatch.context() as m:
        clock.install(m, target, proposer)
        result = SpeculativeDecoder(target, proposer, timer=clock).generate(
            ids, GenerationConfig(max_new_tokens=120, ignore_eos=True))
    assert result.tokens == SpeculativeDecoder(target).generate(
        ids, GenerationConfig(max_new_tokens=120, ignore_eos=True)).tokens
    stats = result.stats
    assert stats.skipped_drafting > stats.num_rounds / 2
    drafted_rounds = stats.num_rounds - stats.skipped_drafting
    assert drafted_rounds >= 4  # the first rounds, then probes


def test_a_new_sequence_starts_from_the_engines_measured_costs(tiny_targets, monkeypatch):
    """The first sequence of an engine knows no costs and verifies its first block whole; the next ones start from
    the measured costs and the drafter's confidence, so a drafter that is 5% sure is not verified whole."""
    target = tiny_targets["qwen3"]
    ids = target.encode_prompt(PROMPTS[2])

    proposer = RandomlySure(target.vocab_size, 7, sure=0.05)
    clock = FakeClock(per_token=0.01)
    with monkeypatch.context() as m:
        clock.install(m, target, proposer)
        decoder = SpeculativeDecoder(target, proposer, timer=clock)
        first, second = (decoder.generate(ids, CONFIG).stats.draft_lengths for _ in range(2))
    assert first[0] == 7 and second[0] < 7


def test_reading_a_prompt_is_not_taken_for_the_cost_of_drafting(tiny_targets, monkeypatch):
    """A drafter's first pass of a sequence also reads the whole prompt (on CPU ~20x a steady round). Counted as
    drafting cost it once kept a good drafter switched off for most of a GSM8K answer; it must not count."""
    target = tiny_targets["llama"]
    ids = target.encode_prompt(" ".join(f"w{i % 50}" for i in range(60)))  # a backlog above CATCH_UP_TOKENS
    reference = ar_tokens(target, ids)
    clock = FakeClock(draft=0.004)

    class Reading(OracleProposer):  # right 60% of the time at most, and dear on the prompt
        backlog = len(ids)

        def context_backlog(self):
            return self.backlog

        def propose(self, sequence, limit=None, keep_going=None):
            clock.now += 1.0 if self.backlog > 1 else 0.0
            self.backlog = 1
            draft = super().propose(sequence, limit)
            return Draft(draft.tokens, [0.6] * len(draft.tokens))

    proposer = Reading(reference, len(ids), 7)
    with monkeypatch.context() as m:
        clock.install(m, target, proposer)
        decoder = SpeculativeDecoder(target, proposer, timer=clock)
        result = decoder.generate(ids, CONFIG)
    assert result.tokens == reference
    assert decoder.engine.costs.drafting == pytest.approx(0.004)
    assert result.stats.skipped_drafting == 0


def test_probes_come_as_often_as_a_budget_of_time_allows():
    """While drafting does not pay, the gap between probes doubles, but only up to where probing costs
    PROBE_BUDGET of the time (drafting and the wider verify): a drafter costing a tenth of a step is probed every
    few rounds, a dear one rarely."""
    from dflash.control import PROBE_BUDGET, PROBE_FIRST, PROBE_MAX

    def widest_gap(draft_seconds: float) -> int:
        costs = CostModel()
        costs.observe(1, 0.050)
        costs.observe_drafting(draft_seconds)
        controller = DraftController(7, costs)
        controller.rate, controller.gain = 20.0, 0.0  # a drafter that never pays
        gaps, since = [], 0
        for _ in range(2000):
            if controller.should_draft():
                gaps.append(since)  # rounds skipped before this probe
                since = 0
            else:
                since += 1
        return max(gaps)

    costs = CostModel()
    costs.observe(1, 0.050)
    verify_extra = costs.cost(2) - costs.cost(1)  # a probe verifies at least one draft
    assert widest_gap(0.005) == max(PROBE_FIRST, math.ceil((0.005 + verify_extra) / (PROBE_BUDGET * 0.050)))
    assert widest_gap(0.200) == PROBE_MAX  # a drafter dearer than a step: probes as rare as ever
    assert widest_gap(0.005) < widest_gap(0.020) < widest_gap(0.200)


def test_whole_blocks_verifies_every_draft(tiny_targets):
    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[0])
    result = SpeculativeDecoder(target, NgramProposer(max_draft=5), adaptive=False).generate(ids, CONFIG)
    drafted = [k for k in result.stats.draft_lengths if k]
    assert result.stats.skipped_drafting == 0 and result.tokens == ar_tokens(target, ids)
    hist = result.stats.draft_length_histogram
    assert len(hist) == 6 and sum(hist) == result.stats.num_rounds and drafted


def test_calibration_learns_the_drafters_real_acceptance():
    calibration = Calibration(positions=4)
    assert calibration.probability(0, 0.9) == pytest.approx(0.9)  # the prior: the drafter's own confidence
    for _ in range(200):  # a drafter that says 0.9 but is right half the time
        calibration.observe([0.9, 0.9], verified=2, accepted=0)
        calibration.observe([0.9, 0.9], verified=2, accepted=2)
    assert calibration.probability(0, 0.92) == pytest.approx(2 / 3, abs=0.01)  # 2 hits in every 3 trials
    assert calibration.probability(0, 0.2) == pytest.approx(0.2)  # other bins keep their prior
    assert calibration.probability(1, None) == pytest.approx(0.5)  # no confidence: by position, prior 0.5


def test_cost_model_interpolates_and_extrapolates():
    costs = CostModel()
    assert not costs.known
    costs.observe(1, 0.030)
    assert costs.cost(5) == pytest.approx(0.030 * 1.2)  # one width seen: 5% a token
    costs.observe(9, 0.046)
    assert costs.cost(5) == pytest.approx(0.038)
    assert costs.cost(17) == pytest.approx(0.062)
    costs.observe(1, 0.040)  # an EMA, not the last reading
    assert 0.030 < costs.cost(1) < 0.040
    values = {2: 1.1, 4: 1.3, 8: 1.5, 16: 2.5}
    assert [_interpolated(values, w) for w in (1, 2, 3, 6, 12, 20)] == pytest.approx([1.0, 1.1, 1.2, 1.4, 2.0, 3.0])


def test_a_first_reading_at_a_batchs_width_never_prices_a_narrower_pass_at_zero_or_less():
    """A batch's first round can be its widest pass (2 rows x 16 tokens); a step read after it must still cost
    something, and never more than the wider pass."""
    wide = CostModel()
    wide.observe(32, 0.050)
    assert [wide.relative_cost(w) > 0 for w in (1, 4, 16)] == [True] * 3  # the 5% slope alone gave 1 - 1.55 at 1
    assert wide.relative_cost(1) <= wide.relative_cost(4) <= wide.relative_cost(16) <= wide.relative_cost(32)
    steep = CostModel()
    steep.seed({16: 1.0, 32: 3.0})  # two widths whose slope, extended, falls below 0 before 1 token
    assert steep.relative_cost(1) == pytest.approx(1 / 16)


def test_a_busy_moment_does_not_make_wide_passes_look_free():
    """A plain step timed while the machine was busy, then only 16-wide passes on a quiet machine: the plain
    step's cost must follow the machine back down, or the controller would keep choosing whole blocks (as a
    per-width EMA did in a benchmark that another job disturbed for a minute)."""
    costs = CostModel()
    for _ in range(20):  # quiet: a step 30 ms, a 16-wide pass 54 ms
        costs.observe(1, 0.030)
        costs.observe(16, 0.054)
    for _ in range(3):
        costs.observe(1, 0.090)  # busy: another job took the cores
    for _ in range(40):
        costs.observe(16, 0.054)  # quiet again, and only wide passes were chosen
    assert costs.cost(16) - costs.cost(1) == pytest.approx(0.024, rel=0.3)
    assert costs.cost(1) == pytest.approx(0.030, rel=0.3)


def test_wider_passes_never_look_cheaper_and_measured_costs_seed_the_model():
    """A width once read cheaper than a plain step (noise) must not make extra drafts look free; relative costs
    measured at load set the shape, the first reading only the machine's level."""
    costs = CostModel()
    costs.observe(1, 0.050)
    costs.observe(3, 0.045)  # a quiet moment
    assert costs.cost(3) >= costs.cost(1) and costs.cost(2) >= costs.cost(1)
    seeded = CostModel()
    seeded.seed({1: 1.0, 2: 1.05, 4: 1.2, 8: 1.4, 16: 1.9})
    seeded.observe(8, 0.070)  # level = 0.070 / 1.4
    assert seeded.cost(1) == pytest.approx(0.050) and seeded.cost(16) == pytest.approx(0.095)
    assert seeded.cost(6) == pytest.approx(0.050 * 1.3)
    batched = CostModel()  # the first reading may be of a width never measured (4 rows x 8 tokens)
    batched.seed({1: 1.0, 8: 1.4, 16: 1.9})
    batched.observe(32, 0.150)
    assert batched.cost(32) == pytest.approx(0.150) and batched.cost(1) < batched.cost(8) < batched.cost(32)


def test_a_batch_wider_than_measured_is_priced_by_its_tokens_and_drafts_only_where_they_pay():
    """Past the widest width measured for one row, a batch's pass costs in proportion to its tokens (bound by its
    arithmetic). So in a batch of 16 no draft pays, however confident (each would widen every row's pass by a
    whole step's worth), where one row alone verifies confident drafts. Before the machine's level is known, the
    first round is a plain step that measures it, instead of verifying every draft."""
    costs = CostModel()
    costs.seed({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.5})
    costs.seed_batches(16 * 8)
    assert costs.relative[32] == pytest.approx(3.0) and costs.relative[128] == pytest.approx(12.0)
    first = DraftController(7, costs)
    assert not costs.known and not first.should_draft() and first.lookup_choice(7)[0] == 0  # a plain first step
    costs.observe(1, 0.020)
    assert costs.known and costs.cost(1) == pytest.approx(0.020) and costs.cost(48) == pytest.approx(0.020 * 4.5)
    confident = [0.95] * 7
    alone = DraftController(7, costs)
    assert alone.choose(confident, 7) >= 3
    assert alone.choose([0.95, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05], 7) < 7
    batch = DraftController(7, costs)
    batch.rows = 16
    assert batch.choose(confident, 7) == 0
    assert batch.lookup_choice(7)[0] == 0
    assert batch.no_draft_can_pay() and not batch.should_draft()  # nor is the drafter run, even to probe
    assert not alone.no_draft_can_pay() and alone.should_draft()
    # the drafting, which every row waits for too: 10 ms a row keeps 8 rows from drafting even a certain block,
    # while their free lookup's drafts may still pay, and so may one row's drafts alone
    costs.observe_drafting(0.010)
    eight = DraftController(7, costs)
    eight.rows = 8
    assert eight.no_draft_can_pay() and not eight._widening_cannot_pay() and not alone.no_draft_can_pay()


def test_a_batch_verifies_drafts_where_they_pay_the_whole_batch():
    """A batch's pass is as wide as its widest row and every row waits for it: 8 rows x 2 tokens cost 0.3 steps
    more than 8 x 1, 2 tokens of the batch's time. A draft a third likely to be accepted pays when every row has
    one (2.6 tokens expected), not when one row alone has it, however sure its drafts: each wider pass costs the
    batch 2 tokens, more than any one draft brings. Row by row, charged alone for the batch's wider pass, no row
    ever verified a draft (8 float32 rows on GSM8K); charged its own time only, one unsure row widened every
    row's pass (`ngram` took 1.2x `ar`'s time)."""
    costs = CostModel()
    costs.seed({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.5})
    costs.observe(1, 0.020)
    rate = 8 / costs.cost(8)  # tokens a second of 8 rows taking plain steps
    unsure, sure = [0.33] * 7, [0.95] * 7
    width, value = batch_width([unsure] * 8, costs, rate)
    assert width == 1 and value == pytest.approx(8 * 0.33 - 2)
    assert batch_width([unsure] + [[]] * 7, costs, rate) == (0, 0.0)
    assert batch_width([sure] + [[0.1]] * 7, costs, rate) == (0, 0.0)
    assert batch_width([sure] * 8, costs, rate)[0] >= 3
    assert batch_width([sure] * 2 + [[0.95]] * 6, costs, rate)[0] == 1  # the rows with one draft gain no more
    alone = DraftController(7, costs)
    assert alone.choose(unsure, 7) >= 1  # a row alone: its draft costs only its own time

def test_batched_rows_share_the_cost_model(tiny_targets):
    target = tiny_targets["qwen3"]
    engine = Engine(target, NgramProposer(max_draft=3), max_batch=3)
    seqs = [engine.submit(target.encode_prompt(p), CONFIG) for p in PROMPTS]
    engine.run()
    assert all(s.controller.costs is engine.costs for s in seqs) and engine.costs.known
    for seq, prompt in zip(seqs, PROMPTS):
        assert seq.result.tokens == ar_tokens(target, target.encode_prompt(prompt))


def test_what_the_drafters_confidence_is_worth_carries_over_to_the_next_sequence(tiny_targets, monkeypatch):
    """A drafter 90% sure of drafts that are never right: the first sequence learns that its confidence means
    nothing; the engine's next sequence starts from that calibration (it is the drafter's, not the text's): it verifies
    one of its first drafts at most (a fresh calibration: all seven), and drafts fewer rounds."""
    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[1])

    proposer = RandomlySure(target.vocab_size, 7, sure=0.9)
    clock = FakeClock(per_token=0.004, draft=0.01)
    with monkeypatch.context() as m:
        clock.install(m, target, proposer)
        decoder = SpeculativeDecoder(target, proposer, timer=clock)
        config = GenerationConfig(max_new_tokens=80, ignore_eos=True)
        first, second = (decoder.generate(ids, config).stats for _ in range(2))
    assert first.draft_lengths[0] == 7  # nothing known yet: the whole block
    assert second.draft_lengths[0] <= 1  # its first drafts, 90% sure, are judged worth one verified at most
    assert second.num_rounds - second.skipped_drafting < first.num_rounds - first.skipped_drafting


def test_reading_drafts_in_steps_never_changes_the_choice():
    """`could_verify_more` after the first drafts of a block: where it says no, `choose` over those drafts picks what
    it picks over the whole block, whatever the calibration, the costs, the rate and the later confidences; and it
    says no often enough to save reading (an always-yes would pass the first check alone)."""
    rng = random.Random(0)
    stopped, chose_later = 0, 0
    for _ in range(500):
        costs = CostModel()
        slope = rng.uniform(0.0, 0.15)
        costs.seed({w: 1.0 + slope * (w - 1) ** rng.uniform(0.7, 1.4) for w in range(1, 9)})
        costs.observe(1, 0.030)
        controller = DraftController(max_draft=7, costs=costs)
        for _ in range(rng.randint(0, 40)):
            confidences = [rng.random() for _ in range(7)]
            controller.calibration.observe(confidences, verified=7, accepted=rng.randint(0, 7))
        controller.rate = rng.uniform(5.0, 120.0)
        confidences = [rng.random() ** rng.choice([0.2, 1.0, 3.0]) for _ in range(7)]
        whole = controller.choose(confidences, 7)
        for read in range(1, 7):
            if controller.could_verify_more(confidences[:read]):
                chose_later += whole > read
                continue
            stopped += 1
            assert controller.choose(confidences[:read], read) == whole
    assert stopped > 500 and chose_later > 100


def test_dflash_reads_fewer_drafts_and_chooses_the_same(tiny_targets, monkeypatch):
    """Under a fixed clock the stepped read of DFlash's drafts (FIRST_READ) verifies the same drafts every round as
    reading whole blocks, with the same output, and reads fewer positions of the LM head."""
    import dflash.methods.dflash.proposer as dflash_proposer

    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[2])

    def run(steps):
        monkeypatch.setattr(dflash_proposer, "FIRST_READ", steps)
        proposer = DFlashProposer(make_drafter(target, 16), target)
        read_drafts, positions = proposer.read_drafts, []

        def counted(hidden, base=None, runners_up=0):
            positions.append(hidden.shape[0] * hidden.shape[1])
            return read_drafts(hidden, base, runners_up)

        clock = FakeClock(per_token=0.0005)
        with monkeypatch.context() as m:
            clock.install(m, target, proposer)
            m.setattr(proposer, "read_drafts", counted)
            result = SpeculativeDecoder(target, proposer, timer=clock).generate(ids, CONFIG)
        return result, sum(positions)

    (stepped, stepped_read), (whole, whole_read) = run(4), run(None)
    assert stepped.tokens == whole.tokens == ar_tokens(target, ids)
    assert stepped.stats.draft_lengths == whole.stats.draft_lengths
    assert stepped.stats.accept_lengths == whole.stats.accept_lengths
    assert max(whole.stats.draft_lengths) > 0
    assert stepped_read < whole_read


def test_reading_in_steps_stops_where_rows_keep_needing_more(tiny_targets):
    """Rows whose controller keeps wanting drafts past FIRST_READ cost a second read each: once that happens more
    often than the measured break-even share, a block is read in one go again (and stepping resumes when they stop
    wanting more); rows that never want more read FIRST_READ positions only."""
    import torch

    from dflash.methods.dflash.proposer import FIRST_READ

    target = tiny_targets["llama"]
    proposer = DFlashProposer(make_drafter(target, 16), target)
    proposer.reading.break_even = 0.5
    reads = []
    read_drafts = proposer.read_drafts

    def counted(hidden, base=None, runners_up=0):
        reads.append(hidden.shape[1])
        return read_drafts(hidden, base, runners_up)

    proposer.read_drafts = counted
    hidden = torch.randn(1, proposer.max_draft, target.hidden_size)

    def one_block(wants_more) -> list[int]:
        reads.clear()
        draft = DFlashProposer._read_in_steps([proposer], hidden, [wants_more])
        assert len(draft[0].tokens) == (proposer.max_draft if sum(reads) == proposer.max_draft else FIRST_READ)
        return list(reads)

    assert [one_block(lambda c: False) for _ in range(3)] == [[FIRST_READ]] * 3
    always = [one_block(lambda c: True) for _ in range(12)]
    assert always[0] == [FIRST_READ, proposer.max_draft - FIRST_READ]
    assert always[-1] == [proposer.max_draft]  # the second read happened too often: one read of the whole block
    never = [one_block(lambda c: False) for _ in range(12)]
    assert never[0] == [proposer.max_draft] and never[-1] == [FIRST_READ]
    assert one_block(None) == [proposer.max_draft]  # no controller to ask: the whole block


# ---- a free lookup beside the drafter (NAME+ngram) ---------------------------------------------------------------
def with_lookup(proposer, lookup):
    proposer.lookup = lookup
    return proposer


def test_a_free_lookup_is_verified_where_the_drafter_is_worth_less(tiny_targets, monkeypatch):
    """A costly drafter that is never right, beside a free lookup that always is: most rounds verify the lookup's
    drafts, many tokens at a time, and the output is still ar's."""
    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[2])
    reference = ar_tokens(target, ids)
    proposer = with_lookup(RandomProposer(target.vocab_size, 7), OracleProposer(reference, len(ids), 7))
    result = generate_under(target, ids, proposer, FakeClock(draft=0.05), monkeypatch)
    assert result.tokens == reference
    stats = result.stats
    assert stats.lookup_rounds > stats.num_rounds / 2 and stats.tau > 3


def test_a_drafter_worth_more_than_its_lookup_keeps_drafting(tiny_targets, monkeypatch):
    """The reverse: an always-right, cheap, confident drafter beside a lookup that is never right: the lookup is
    tried while its calibration is young, then rounds draft."""
    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[2])
    reference = ar_tokens(target, ids)
    proposer = with_lookup(SureOracle(reference, len(ids), 7, 0.95), RandomProposer(target.vocab_size, 7))
    result = generate_under(target, ids, proposer, FakeClock(draft=0.001), monkeypatch)
    assert result.tokens == reference
    stats = result.stats
    assert stats.lookup_rounds <= 2 and stats.tau > 4


def test_lookup_outcomes_calibrate_the_lookup_alone():
    """What the target accepted of the lookup's drafts teaches the lookup's calibration, not the drafter's; a
    round whose lookup is worth more than drafting skips the drafter without starting a streak of skips."""
    costs = CostModel()
    costs.observe(1, 0.010)
    controller = DraftController(7, costs)
    controller.record(True, [0.9] * 7, 7, 7, 0.002, 0.012)
    drafter_tried = list(controller.calibration.tried)
    controller.record(True, [0.9] * 7, 4, 0, 0.002, 0.011, lookup=True)
    assert controller.calibration.tried == drafter_tried
    assert controller.lookup_calibration.position_tried[0] == 1 and controller.lookup_calibration.position_accepted[0] == 0
    controller.gain, controller.rate, costs.drafting = 2.0, 100.0, 0.002  # drafting is worth 2 - 0.2 tokens a round
    assert controller.should_draft(alternative=1.0)
    assert not controller.should_draft(alternative=1.9)
    assert controller.skips_left == 0 and controller.should_draft()
    assert controller.lookup_choice(0) == (0, 0.0)
    k, value = controller.lookup_choice(7)
    assert 0 <= k <= 7 and value >= 0


def test_whole_blocks_never_take_the_lookup(tiny_targets):
    target = tiny_targets["qwen3"]
    ids = target.encode_prompt(PROMPTS[1])
    reference = ar_tokens(target, ids)
    proposer = with_lookup(RandomProposer(target.vocab_size, 5), OracleProposer(reference, len(ids), 5))
    result = SpeculativeDecoder(target, proposer, adaptive=False).generate(ids, CONFIG)
    assert result.tokens == reference and result.stats.lookup_rounds == 0
    assert set(result.stats.draft_lengths[:-1]) == {5}


def test_wide_passes_cost_more_after_a_longer_context():
    """Relative costs measured after two contexts: each width's grows linearly with the context of the pass (its
    attention), extrapolates past the longer one, and the online shape corrections still apply."""
    costs = CostModel()
    costs.seed({1: 1.0, 4: 1.1, 16: 1.6}, 64, {512: {1: 1.0, 4: 1.3, 16: 2.2}})
    costs.observe(1, 0.010, context=300)
    assert costs.cost(4, 64) == pytest.approx(0.011) and costs.cost(4, 512) == pytest.approx(0.013)
    assert costs.cost(4, 288) == pytest.approx(0.012) and costs.cost(16, 960) == pytest.approx(0.028)
    assert costs.cost(8, 512) == pytest.approx(0.010 * (1.3 + 0.9 * 4 / 12))  # between measured widths
    assert costs.cost(1, 2000) == pytest.approx(0.010) and costs.cost(2, 0) >= costs.cost(1, 0)
    assert costs.cost(4) == pytest.approx(0.011)  # no context given: the reference one
    controller = DraftController(7, costs)
    controller.context = 64
    short = controller._extra_cost(4)
    controller.context = 1000
    assert controller._extra_cost(4) > 2 * short


def test_growth_is_fitted_over_every_context_and_never_faster_for_a_narrower_pass():
    """The growth per token of context is the least-squares slope over the measured contexts, pooled so that a
    narrower pass never grows faster than a wider one. The float32 SmolLM2 costs measured at load on 2 Zen 4 cores
    (64 and 512 tokens; 1536 added), where a 2-token pass's noise had priced it at 1.96x a step after 2750 tokens
    against 1.10-1.13x measured there; a 16-token pass 3.5-3.8x measured."""
    from dflash.control import growth_by_width

    assert growth_by_width({0: {1: 1.0, 4: 1.2}, 100: {1: 1.0, 4: 1.3}, 200: {1: 1.0, 4: 1.4}}) == {
        1: 0.0, 4: pytest.approx(0.001)}
    short = {1: 1.0, 2: 1.0253, 4: 1.2036, 8: 1.4474, 16: 2.2125}
    middle = {1: 1.0, 2: 1.18, 4: 1.39, 8: 1.51, 16: 2.60}
    long = {1: 1.0, 2: 1.08, 4: 1.57, 8: 1.82, 16: 2.83}
    growth = growth_by_width({64: short, 512: middle, 1536: long})
    assert list(growth.values()) == sorted(growth.values()) and growth[1] == 0.0
    costs = CostModel()
    costs.seed(short, 64, {512: middle, 1536: long})
    costs.observe(1, 0.010, context=64)
    assert costs.relative_cost(2, 2750) < 1.25
    assert 3.0 < costs.relative_cost(16, 2750) < 4.0
    two_contexts = CostModel()
    two_contexts.seed(short, 64, {512: middle})
    two_contexts.observe(1, 0.010, context=64)
    assert two_contexts.relative_cost(2, 2750) > 1.7  # what two nearby contexts alone had priced it at


def test_a_position_no_round_has_reached_starts_from_the_one_before_it():
    """Prompt lookup's drafts by position: a later position starts from what the position before it has learnt, so
    first drafts that are nearly always right make a second one worth verifying. At a flat prior of 0.5 a
    controller verifying one draft a round never learnt its second position (tau 1.75 on a repetitive 2750-token
    prompt)."""
    calibration = Calibration(positions=7)
    for _ in range(20):
        calibration.observe(None, verified=1, accepted=1, label=5)
    first, second, last = (calibration.probability(j, None, 5) for j in (0, 1, 6))
    assert first > 0.9 and second == pytest.approx(first) and last == pytest.approx(first)
    assert calibration.probability(1, None, 3) == pytest.approx(0.5)  # another label: its own chain
    for _ in range(20):
        calibration.observe(None, verified=2, accepted=1, label=5)  # second drafts now observed: all wrong
    assert calibration.probability(1, None, 5) < 0.2 and calibration.probability(2, None, 5) < 0.2
    costs = CostModel()
    costs.seed({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6})
    costs.observe(1, 0.020)
    controller = DraftController(7, costs, lookup_calibration=Calibration(7))
    for _ in range(20):
        controller.lookup_calibration.observe(None, verified=1, accepted=1, label=5)
    assert controller.lookup_choice(7, label=5)[0] > 1


def test_drafts_without_confidence_are_calibrated_by_their_label():
    """Prompt lookup's drafts carry the length of the match they copied (their label): a 3-token match that is
    always right and a 1-token match that never is get probabilities of their own, where position alone would
    average them."""
    calibration = Calibration(positions=4)
    for _ in range(50):
        calibration.observe(None, verified=3, accepted=3, label=3)
        calibration.observe(None, verified=3, accepted=0, label=1)
    assert calibration.probability(0, None, 3) > 0.9 and calibration.probability(2, None, 3) > 0.9
    assert calibration.probability(0, None, 1) < 0.1
    assert calibration.probability(0, None) == pytest.approx(0.5)  # unlabelled: still the prior
    assert NgramProposer(max_draft=4).propose([5, 6, 7, 9, 5, 6, 7]).label == 3
    assert NgramProposer(max_draft=4).propose([5, 6, 7, 9, 6, 7]).label == 2


def test_a_wider_pass_is_priced_at_least_as_a_narrower_one_at_every_context():
    """The price of a width is the largest of its own and every narrower width's, each at the context priced (kept
    per context between readings, dropped at each reading)."""
    rng = random.Random(3)
    costs = CostModel()
    costs.seed({1: 1.0, 2: 1.3, 3: 1.2, 4: 1.5, 8: 1.4, 16: 2.0}, 64,
               {512: {1: 1.0, 2: 1.2, 3: 1.5, 4: 1.4, 8: 2.2, 16: 2.9}})
    costs.observe(1, 0.010, 64)
    for reading in range(30):
        costs.observe(rng.choice([1, 2, 4, 8, 16, 24]), rng.uniform(0.01, 0.04), rng.choice([None, 64, 300]))
        for context in (None, 64, 300, 900):
            for width in (1, 2, 3, 5, 8, 12, 16, 20, 24, 40):
                naive = max(costs._at(w, context) for w in [width, *costs.relative] if w <= width)
                assert costs.relative_cost(width, context) == pytest.approx(naive)


def test_a_batch_stops_drafting_once_even_its_best_drafts_could_not_pay():
    """8 rows, a drafter costing 5 ms a row: a certain block of 7 drafts in every row would pay for its drafting
    and wider pass (7 tokens a row for 5.7 tokens' time), so a new drafter is tried. Once the verified drafts put
    every position's chance at 0.68 or less, even a block of the likeliest drafts could not (1.5 tokens), and the
    batch neither drafts nor probes; a row alone, where drafting and a wider pass cost far less, still drafts."""
    costs = CostModel()
    costs.seed({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.5})
    costs.seed_batches(8 * 8)
    costs.observe(1, 0.020)
    costs.observe_drafting(0.005)
    calibration = Calibration(7)
    batch, alone = DraftController(7, costs, calibration=calibration), DraftController(7, costs, calibration=calibration)
    batch.rows = 8
    assert calibration.best() == 1.0 and not batch.no_draft_can_pay() and batch.should_draft()
    calibration.observe(None, verified=7, accepted=2)
    assert calibration.best() == pytest.approx(0.68)  # position 1: (1 + 4 x 0.6) / 5, its prior position 0's 0.6
    assert batch.no_draft_can_pay() and not batch.should_draft()
    assert not alone.no_draft_can_pay() and alone.should_draft()


def test_a_row_alone_keeps_probing_whatever_its_calibration_says():
    """A drafter as dear as a step, whose verified drafts put every chance at 0.4 or less: a batch of two stops
    drafting, while a row alone keeps the bound of certain drafts (a block of 7 would pay), so its probes can
    still find out that the text turned predictable."""
    costs = CostModel()
    costs.seed({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.5})
    costs.observe(1, 0.020)
    costs.observe_drafting(0.020)
    calibration = Calibration(7)
    calibration.observe(None, verified=7, accepted=0)
    assert calibration.best() == pytest.approx(0.4)  # the later positions, never reached, inherit the first's
    alone, pair = DraftController(7, costs, calibration=calibration), DraftController(7, costs, calibration=calibration)
    pair.rows = 2
    assert pair.no_draft_can_pay() and not alone.no_draft_can_pay()
