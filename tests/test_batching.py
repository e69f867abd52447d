"""Continuous batching in the engine: every row of a batch decodes exactly what it would alone, rows join and leave
at round boundaries, and one row's stop, cancellation or bad settings never touch the others."""

import pytest

from conftest import ARCHS, OracleProposer, RandomProposer
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.methods.ngram import NgramProposer
from dflash.sampling import SamplingConfig
from test_engine import make_drafter, with_lookup

PROMPTS = ["w1 w2 w3 w4 w5", "w7 w7 w7", "w20 w31 w9 w9 w40 w12 w3", "w5", "w11 w12 w11 w12 w11", "w40 w41"]
LENGTHS = [30, 12, 41, 7, 25, 18]  # rows leave at different rounds, so waiting ones join mid-batch


def solo(target, ids, max_new):
    return SpeculativeDecoder(target).generate(ids, GenerationConfig(max_new_tokens=max_new, ignore_eos=True)).tokens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("max_batch", [2, 4])
def test_batched_rows_equal_their_solo_outputs(tiny_targets, arch, max_batch):
    target = tiny_targets[arch]
    prompts = [target.encode_prompt(p) for p in PROMPTS]
    expected = [solo(target, ids, n) for ids, n in zip(prompts, LENGTHS)]
    proposers = {"ar": None, "ngram": NgramProposer(max_draft=5), "dflash": make_drafter_proposer(target),
                 "random": RandomProposer(target.vocab_size, 4),
                 "dflash+ngram": with_lookup(make_drafter_proposer(target), NgramProposer(max_draft=7))}
    for name, proposer in proposers.items():
        engine = Engine(target, proposer, max_batch=max_batch)
        seqs = [engine.submit(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True))
                for ids, n in zip(prompts, LENGTHS)]
        widest = 0
        while engine.busy:
            engine.step()
            widest = max(widest, len(engine.running))
        assert widest == max_batch  # the batch really filled up
        for seq, reference in zip(seqs, expected):
            assert seq.result.tokens == reference, f"{name}: a batched row differs from its solo output"
            assert seq.result.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_bfloat16_rounds_wider_than_sixteen_tokens_equal_solo_outputs(arch, bf16_layout):
    """bfloat16 sums tie often, so a batched verify pass must run each row through the chains its steps alone run:
    4 rows verifying whole blocks of 8 (32 tokens a pass) and random drafts, against each row's solo `ar`."""
    import torch

    from dflash.models.target import choose_kernels
    from dflash.testing import tiny_target

    target = tiny_target(arch, logit_scale=0.5, hidden_size=256)  # flat logits, long sums: ties that rounding decides
    target.model.to(torch.bfloat16)
    choose_kernels(target, "native")
    prompts = [target.encode_prompt(p) for p in PROMPTS[:4]]
    expected = [solo(target, ids, n) for ids, n in zip(prompts, LENGTHS)]
    for proposer in (RandomProposer(target.vocab_size, 7), make_drafter_proposer(target)):
        engine = Engine(target, proposer, max_batch=4, adaptive=False)
        seqs = [engine.submit(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True))
                for ids, n in zip(prompts, LENGTHS)]
        engine.run()
        for seq, reference in zip(seqs, expected):
            assert seq.result.tokens == reference, f"{proposer.name}: a batched bfloat16 row differs from its solo run"


def make_drafter_proposer(target):
    from dflash.methods.dflash.proposer import DFlashProposer

    return DFlashProposer(make_drafter(target, 8), target)


def test_oracle_rows_accept_whole_blocks_side_by_side(tiny_targets):
    target = tiny_targets["qwen3"]
    prompts = [target.encode_prompt(p) for p in PROMPTS[:3]]
    references = [solo(target, ids, 40) for ids in prompts]
    engine = Engine(target, None, max_batch=3, adaptive=False)  # whole blocks: every round verifies 7 drafts
    seqs = []
    for ids, ref in zip(prompts, references):
        engine.proposer = OracleProposer(ref, len(ids), 7)  # each row its own oracle (the template is copied)
        seqs.append(engine.submit(ids, GenerationConfig(max_new_tokens=40, ignore_eos=True)))
    engine.run()
    for seq, ref in zip(seqs, references):
        assert seq.result.tokens == ref
        assert seq.stats.accept_lengths[:-1] == [8] * (len(seq.stats.accept_lengths) - 1)


def test_stop_cancel_and_bad_requests_stay_in_their_row(tiny_targets):
    target = tiny_targets["llama"]
    ids = [target.encode_prompt(p) for p in PROMPTS[:3]]
    reference = solo(target, ids[0], 40)
    engine = Engine(target, NgramProposer(max_draft=3), max_batch=3)
    stopped = engine.submit(ids[0], GenerationConfig(max_new_tokens=40, ignore_eos=True,
                                                     stop_token_ids=(reference[9],)))
    seen = []
    cancelled = engine.submit(ids[1], GenerationConfig(max_new_tokens=40, ignore_eos=True),
                              on_tokens=lambda new: seen.extend(new) or len(seen) < 6)
    with pytest.raises(UserError):
        engine.submit(ids[2], GenerationConfig(max_new_tokens=0))
    plain = engine.submit(ids[2], GenerationConfig(max_new_tokens=33, ignore_eos=True))
    engine.run()
    first = reference.index(reference[9])
    assert stopped.result.tokens == reference[: first + 1] and stopped.result.finish_reason == "stop"
    assert cancelled.result.finish_reason == "cancelled" and 6 <= len(cancelled.result.tokens) < 40
    assert plain.result.tokens == solo(target, ids[2], 33)


def test_cancel_before_start_and_while_running(tiny_targets):
    target = tiny_targets["gemma3"]
    ids = [target.encode_prompt(p) for p in PROMPTS[:3]]
    engine = Engine(target, None, max_batch=1)
    running = engine.submit(ids[0], GenerationConfig(max_new_tokens=30, ignore_eos=True))
    queued = engine.submit(ids[1], GenerationConfig(max_new_tokens=30, ignore_eos=True))
    engine.step()
    engine.cancel(queued)  # never started: dropped at once
    assert queued.result.finish_reason == "cancelled" and queued.result.tokens == []
    engine.cancel(running)
    engine.run()
    assert running.result.finish_reason == "cancelled" and 0 < len(running.result.tokens) < 30
    assert not engine.busy


def test_seeded_sampling_in_a_batch_is_reproducible(tiny_targets):
    target = tiny_targets["qwen3"]
    ids = [target.encode_prompt(p) for p in PROMPTS[:4]]

    def sample_all():
        engine = Engine(target, NgramProposer(max_draft=3), max_batch=4)
        seqs = [engine.submit(i, GenerationConfig(max_new_tokens=20, ignore_eos=True,
                                                  sampling=SamplingConfig(temperature=1.0, seed=k)))
                for k, i in enumerate(ids)]
        engine.run()
        return [s.result.tokens for s in seqs]

    assert sample_all() == sample_all()


@pytest.mark.parametrize("draft_vocab", [None, list(range(5, 40))], ids=["whole-vocabulary", "draft-vocabulary"])
def test_dflash_drafts_a_whole_batch_in_one_pass(tiny_targets, draft_vocab):
    """propose_batch gives each row the drafts, confidences and runners-up (where it asks for them) it gets alone,
    over rounds in which the rows' contexts grow by different amounts; a row whose `keep_going` says no after the
    first FIRST_READ positions gets their drafts alone, the others the whole block."""
    import copy

    import torch

    from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter
    from dflash.methods.dflash.proposer import FIRST_READ, DFlashProposer

    target = tiny_targets["gemma3"]
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, 2, num_layers=2, block_size=6, num_features=2)
    drafter = DFlashDrafter.untrained(cfg, seed=1)
    with torch.no_grad():
        for p in drafter.parameters():
            p.mul_(20)  # a sharper random drafter: distinct argmaxes make the comparison meaningful
    drafter.draft_vocab = draft_vocab  # its base head, plus each row's own prompt tokens (40-59 here)
    template = DFlashProposer(drafter.freeze(), target)
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(5, 60, (n,), generator=gen).tolist() for n in (9, 17, 12)]
    features = [target.forward(torch.tensor([s[:-1]]), None, template.feature_layers).features for s in sequences]
    alone, together, stepped = ([copy.copy(template) for _ in sequences] for _ in range(3))
    for proposers in (alone, together, stepped):
        for p, s, f, runners_up in zip(proposers, sequences, features, (2, 0, 3)):
            p.start(s[:-1], f)
            p.alternatives = runners_up
    for grow in ((0, 0, 0), (3, 1, 2), (1, 5, 1)):
        for i, n in enumerate(grow):  # commit n more tokens (their features) before the next round
            if n:
                more = torch.randint(5, 60, (n,), generator=gen).tolist()
                feats = target.forward(torch.tensor([sequences[i] + more]), None, template.feature_layers).features
                new = feats[:, len(sequences[i]) - 1: len(sequences[i]) - 1 + n]
                for p in (alone[i], together[i], stepped[i]):
                    p.commit(sequences[i][-1:] + more[:-1], new)
                sequences[i] = sequences[i] + more
        solo = [p.propose(s) for p, s in zip(alone, sequences)]
        batch = DFlashProposer.propose_batch(together, sequences, [None] * len(sequences))
        partly = DFlashProposer.propose_batch(stepped, sequences, [lambda c: False, None, lambda c: len(c) < 4])
        first_step = FIRST_READ
        for a, b, c, read in zip(solo, batch, partly, (first_step, template.max_draft, first_step)):
            assert a.tokens == b.tokens and c.tokens == a.tokens[:read]
            torch.testing.assert_close(torch.tensor(a.confidence), torch.tensor(b.confidence), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(torch.tensor(a.confidence[:read]), torch.tensor(c.confidence),
                                       atol=1e-5, rtol=1e-4)
            runners_up = [[t for t, _ in others] for others in a.alternatives] if a.alternatives else None
            assert runners_up == ([[t for t, _ in o] for o in b.alternatives] if b.alternatives else None)
            assert (runners_up and runners_up[:read]) == ([[t for t, _ in o] for o in c.alternatives]
                                                          if c.alternatives else None)
        assert [len(d.alternatives[0]) if d.alternatives else 0 for d in solo] == [2, 0, 3]
        assert len(set(tuple(d.tokens) for d in solo)) > 1


def test_a_batch_verifies_the_drafts_that_pay_for_the_whole_batch(tiny_targets, monkeypatch):
    """Passes timed on a fake clock as a fixed weight read plus a cost per token: 4 rows with sure drafts (an
    oracle) gain 4 tokens per draft they verify, for 1.1 tokens of the batch's time. Decided for the batch as a
    whole, every round after the second verifies drafts in every row (more as the calibration learns they are
    all accepted); row by row, each row was charged the whole
    batch's wider pass for its own single token, and no round ever did. Outputs stay each row's solo output."""
    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[0])
    reference = solo(target, ids, 40)
    clock, shapes, forward = [0.0], [], target.forward

    def timed(tokens, *args, **kwargs):
        clock[0] += 0.010 + 0.001 * tokens.numel()
        shapes.append(tuple(tokens.shape))
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(target, "forward", timed)
    engine = Engine(target, OracleProposer(reference, len(ids), 7), max_batch=4, timer=lambda: clock[0])
    seqs = [engine.submit(ids, GenerationConfig(max_new_tokens=40, ignore_eos=True)) for _ in range(4)]
    engine.run()
    assert all(seq.result.tokens == reference for seq in seqs)
    rounds = [width for rows, width in shapes if rows == 4]
    # the first round verifies whole blocks (no costs known yet) and the second is priced from that one reading
    assert len(rounds) >= 4 and min(rounds[2:]) >= 2, rounds


def test_a_batch_round_is_read_into_the_cost_model_once(tiny_targets, monkeypatch):
    """The rows of a batch share one pass (and one drafting pass): the shared cost model reads each round once,
    not once per row (16 rows had moved the machine's level 93% of the way toward every single pass)."""
    from dflash.control import CostModel

    target = tiny_targets["llama"]
    prompts = [target.encode_prompt(p) for p in PROMPTS[:4]]
    readings, drafting, rounds = [], [], []
    observe, observe_drafting, one_round = CostModel.observe, CostModel.observe_drafting, Engine._round
    monkeypatch.setattr(CostModel, "observe", lambda self, *a: readings.append(a[0]) or observe(self, *a))
    monkeypatch.setattr(CostModel, "observe_drafting", lambda self, s: drafting.append(s) or observe_drafting(self, s))
    monkeypatch.setattr(Engine, "_round", lambda self: rounds.append(len(self.running)) or one_round(self))
    engine = Engine(target, NgramProposer(max_draft=5), max_batch=4)
    for ids in prompts:
        engine.submit(ids, GenerationConfig(max_new_tokens=12, ignore_eos=True))
    engine.run()
    assert max(rounds) == 4 and len(readings) == len(rounds) and 0 < len(drafting) <= len(rounds)
    assert all(width % rows == 0 for width, rows in zip(readings, rounds))  # rows x the widest block
