"""Frozen inference linears (models/kernels.py): the same products as F.linear through either kernel, packed copies
that follow moves and in-place writes, fused projections, and kernel plans chosen by (injected) timings and cached
per machine."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ARCHS, OracleProposer, RandomProposer
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.ngram import NgramProposer
from dflash.models import native
from dflash.models.kernels import (
    INT8,
    PACKED,
    PLAIN,
    FrozenLinear,
    KernelPlan,
    int8_supported,
    kernel_plan_for,
    measure_plan,
    packing_supported,
    shape_key,
)
from dflash.models.target import choose_kernels
from dflash.testing import tiny_target
from test_engine import make_drafter

needs_packing = pytest.mark.skipif(FrozenLinear(torch.randn(4, 4)).packed() is None,
                                   reason="this PyTorch build or CPU has no oneDNN float32 packing")


def bf16_packs() -> bool:
    return FrozenLinear(torch.randn(4, 4).bfloat16()).packed() is not None


@needs_packing
@pytest.mark.parametrize("rows", [1, 2, 17, 100])
@pytest.mark.parametrize("plan", [PACKED, PLAIN], ids=["packed", "plain"])
def test_float32_product_matches_f_linear(rows, plan):
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 96), torch.randn(300)
    frozen = FrozenLinear(weight, bias, plan)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(frozen(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, rows, 96)  # batched [B, T, D] inputs keep their shape
    assert frozen(x3).shape == (2, rows, 300)
    torch.testing.assert_close(frozen(x3), F.linear(x3, weight, bias), rtol=1e-5, atol=1e-4)


def test_bfloat16_product_matches_f_linear():
    torch.manual_seed(0)
    weight = torch.randn(300, 96).bfloat16()
    frozen = FrozenLinear(weight)
    for rows in (1, 15, 200):
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(frozen(x).float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
    assert (frozen.packed() is not None) == bf16_packs()  # packed only where the CPU has a bf16 kernel


def test_falls_back_where_the_packed_kernel_does_not_apply():
    torch.manual_seed(0)
    weight = torch.randn(8, 4)
    frozen = FrozenLinear(weight)
    x = torch.randn(3, 4, requires_grad=True)
    frozen(x).sum().backward()  # autograd: the F.linear path, so gradients exist and are exact
    torch.testing.assert_close(x.grad, weight.sum(0).expand(3, 4))
    half = FrozenLinear(weight.half())  # float16 is never packed
    assert half.packed() is None
    torch.testing.assert_close(half(x.detach().half()).float(), F.linear(x.detach(), weight), rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError):  # an input of another dtype than the weight: F.linear raises as it always did
        frozen(x.detach().double())


@needs_packing
def test_packed_copy_follows_moves_and_writes():
    """A packed layout is never stale: after .to(dtype) or an in-place write the product is the new weight's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48))
    frozen = FrozenLinear.of(model[0])
    x = torch.randn(3, 32)
    frozen(x)  # packs
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # shared storage, written in place
    torch.testing.assert_close(frozen(x), model[0](x), rtol=1e-5, atol=1e-5)
    frozen.to(torch.bfloat16)
    assert frozen.weight.dtype == torch.bfloat16
    xb = x.bfloat16()
    torch.testing.assert_close(frozen(xb).float(), F.linear(xb, frozen.weight, frozen.bias).float(),
                               rtol=2e-2, atol=2e-2)
    frozen.to(torch.float32)
    torch.testing.assert_close(frozen(x), model[0](x), rtol=1e-2, atol=1e-1)  # back from a bf16 round trip


def test_fused_projection_equals_the_parts_and_shares_memory():
    torch.manual_seed(0)
    parts = [nn.Linear(16, n, bias=b) for n, b in ((24, True), (8, False), (8, True))]
    x = torch.randn(5, 16)
    expected = torch.cat([p(x) for p in parts], dim=-1)
    fused = FrozenLinear.fused(parts)
    torch.testing.assert_close(fused(x), expected)
    assert parts[1].weight.data_ptr() == fused.weight[24:].data_ptr()  # the parts now view the fused weight
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=-1), expected)
    assert not any(k.endswith("weight") for k in fused.state_dict())  # a frozen twin adds no checkpoint keys


class FakeClock:
    """A timer under test control: each kernel call advances it by a cost the test decides."""

    def __init__(self):
        self.now, self.calls = 0.0, 0

    def __call__(self):
        self.calls += 1
        return self.now


@needs_packing
def test_plan_follows_the_timings_and_is_deterministic(monkeypatch):
    """With a clock that says plain is 2x faster for 1 row of the 64x32 weight and packed faster elsewhere, the
    plan picks exactly that, every time."""
    clock = FakeClock()
    linears = [FrozenLinear(torch.randn(64, 32)) for _ in range(3)] + [FrozenLinear(torch.randn(16, 32))]

    def fake_run(self, x, kernel):
        plain_wins = self.out_features == 64 and x.shape[0] == 1
        slow = kernel == ("packed" if plain_wins else "plain")
        clock.now += 2.0 if slow else 1.0
        return x

    monkeypatch.setattr(FrozenLinear, "run", fake_run)
    plans = [measure_plan(linears, rows=(1, 8), timer=clock) for _ in range(2)]
    assert plans[0].choices == plans[1].choices
    choices = plans[0].choices
    assert choices[shape_key(64, 32, torch.float32, 1)] == "plain"
    assert choices[shape_key(64, 32, torch.float32, 16)] == "packed"  # the 2-16 bucket, measured at 8
    assert choices[shape_key(16, 32, torch.float32, 1)] == "packed"
    assert plans[0].kernel(64, 32, torch.float32, 1) == "plain" and plans[0].kernel(64, 32, torch.float32, 9) == "packed"


@needs_packing
def test_cached_plan_is_reused_on_the_same_machine_only(tmp_path, monkeypatch):
    clock = FakeClock()

    def fake_run(self, x, kernel):
        clock.now += 1.0
        return x

    monkeypatch.setattr(FrozenLinear, "run", fake_run)
    linears = [FrozenLinear(torch.randn(64, 32))]
    cache = tmp_path / "plans.json"
    plan, measured = kernel_plan_for("m", linears, fingerprint="cpu-a", cache_file=cache, timer=clock)
    assert measured and clock.calls > 0
    calls = clock.calls
    again, measured = kernel_plan_for("m", linears, fingerprint="cpu-a", cache_file=cache, timer=clock)
    assert not measured and clock.calls == calls and again.choices == plan.choices
    _, measured = kernel_plan_for("m", linears, fingerprint="cpu-b", cache_file=cache, timer=clock)
    assert measured and clock.calls > calls  # another CPU (or torch build, or thread count): measured anew


def test_a_cached_plan_the_cached_check_rejects_is_measured_again(tmp_path):
    from dflash.models.kernels import cached_measurement

    cache, made = tmp_path / "plans.json", []

    def measure():
        made.append(1)
        return {"step_ms": 10.0 * len(made)}

    assert cached_measurement("m", measure, "cpu-a", cache) == ({"step_ms": 10.0}, True)
    assert cached_measurement("m", measure, "cpu-a", cache, still_valid=lambda e: True) == ({"step_ms": 10.0}, False)
    assert cached_measurement("m", measure, "cpu-a", cache, still_valid=lambda e: False) == ({"step_ms": 20.0}, True)
    assert cached_measurement("m", measure, "cpu-a", cache) == ({"step_ms": 20.0}, False)  # the new one was kept


@pytest.mark.parametrize("now_ms, fits", [(10.0, False), (40.0, False), (45.0, True), (200.0, True)])
def test_a_plan_measured_on_a_busier_machine_is_stale(now_ms, fits):
    """Its recorded 1-token pass (the faster of the two timed, 50 ms) against one timed now (injected clock): much
    faster now means the plan was chosen under load and is measured again; as fast, or slower (a busy machine
    now), keeps it."""
    from dflash.models.target import plan_still_fits

    target = tiny_target("llama")
    clock = FakeClock()
    real_forward = target.forward

    def timed_forward(ids, cache=None, *args, **kwargs):
        clock.now += now_ms / 1000 if ids.shape[1] == 1 else 0.0
        return real_forward(ids, cache, *args, **kwargs)

    target.forward = timed_forward
    plan = KernelPlan({}, "plain", {"1-token pass": {"measured": 80.0, "fused": 50.0}})
    assert plan_still_fits(target, plan, timer=clock) is fits
    assert plan_still_fits(target, KernelPlan({}, "plain", {}), timer=clock)  # nothing recorded: nothing to judge


def test_machine_fingerprint_changes_with_the_thread_count():
    from dflash.models.kernels import machine_fingerprint

    before = torch.get_num_threads()
    try:
        a = machine_fingerprint()
        torch.set_num_threads(before + 1)
        assert machine_fingerprint() != a
    finally:
        torch.set_num_threads(before)


@needs_packing
@pytest.mark.parametrize("kernels", ["packed", "native"])
@pytest.mark.parametrize("arch", ARCHS)
def test_kernel_choice_never_changes_greedy_output(arch, kernels):
    packed, plain = tiny_target(arch, logit_scale=4.0), tiny_target(arch, logit_scale=4.0)
    choose_kernels(packed, kernels)
    choose_kernels(plain, "plain")
    ids = packed.encode_prompt("w20 w31 w9 w9 w40 w12 w3")
    got = packed.forward(torch.tensor([ids])).logits
    expected = plain.forward(torch.tensor([ids])).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    reference = SpeculativeDecoder(plain).generate(ids, config)
    drafter = make_drafter(packed, 8)
    for proposer in (DFlashProposer(drafter, packed), NgramProposer(max_draft=7),
                     RandomProposer(packed.vocab_size, 7), OracleProposer(reference.tokens, len(ids), 7)):
        result = SpeculativeDecoder(packed, proposer).generate(ids, config)
        assert result.tokens == reference.tokens, f"{proposer.name} changed the greedy output"


def test_plan_summary_and_defaults():
    plan = KernelPlan({shape_key(4, 4, torch.float32, 1): "plain"}, default="packed")
    assert plan.summary() == {"plain": 1, "packed": 0, "native": 0}
    assert plan.kernel(8, 8, torch.float32, 1) == "packed" and plan.kernel(4, 4, torch.float32, 1) == "plain"
    assert packing_supported(torch.randn(2, 2)) in (True, False)


needs_int8 = pytest.mark.skipif(not int8_supported(torch.randn(1)) or FrozenLinear(torch.randn(8, 8)).int8() is None,
                                reason="this PyTorch build or CPU has no fbgemm int8 kernel")


@needs_int8
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_int8_product_is_close_to_f_linear(rows):
    """Drafters only: int8 weights per output channel, so the product is near F.linear, not equal to it."""
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 96), torch.randn(300)
    frozen = FrozenLinear(weight, bias, INT8)
    x3 = torch.randn(2, rows, 96)
    got, expected = frozen(x3), F.linear(x3, weight, bias)
    assert got.shape == expected.shape == (2, rows, 300)
    relative = (got - expected).abs().max() / expected.abs().max()
    assert 0 < relative < 0.03  # inexact (it is really int8), but within ~1% of the output's scale
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@needs_int8
def test_int8_copy_follows_writes_and_other_dtypes_fall_back():
    torch.manual_seed(0)
    weight = torch.randn(64, 32)
    frozen = FrozenLinear(weight.clone(), None, INT8)
    x = torch.randn(3, 32)
    frozen(x)
    with torch.no_grad():
        frozen.weight.mul_(-2)  # an in-place write: the int8 copy must be remade
    expected = F.linear(x, -2 * weight)
    assert (frozen(x) - expected).abs().max() < 0.05 * expected.abs().max()  # a stale copy would be off by 3x
    frozen.to(torch.bfloat16)  # no int8 kernel for bf16 weights: F.linear, exactly
    xb = x.bfloat16()
    assert torch.equal(frozen(xb), F.linear(xb, frozen.weight))


needs_vnni = pytest.mark.skipif(not native.int8_vnni(), reason="no AVX512-VNNI kernel here")


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vnni_kernel_is_an_int8_product_within_its_rounding(dtype):
    """The "vnni" kernel (a drafter's LM head): each weight row rounded to int8 on its own scale s_i, each input row
    to int16, summed in integers; float32 out whatever the weight's dtype, within the two roundings of the exact
    product: |error_i| <= s_i / 2 |x|_1 + max|x| / 65534 |w_i|_1 (plus float slack). A bias is added."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(100, 72, generator=g) * 0.05).to(dtype)
    bias = torch.randn(100, generator=g).to(dtype)
    scales = weight.float().abs().amax(dim=1) / 127
    for b in (None, bias):
        frozen = FrozenLinear(weight, b, KernelPlan(default="vnni"))
        for rows in (1, 3, 4, 9, 16):
            x = torch.randn(rows, 72, generator=g).to(dtype)
            got = frozen(x)
            exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
            assert got.dtype == torch.float32 and got.shape == (rows, 100)
            xs = x.double()
            bound = (scales.double()[None] / 2 * xs.abs().sum(-1, keepdim=True)
                     + xs.abs().amax(-1, keepdim=True) / 65534 * weight.double().abs().sum(-1)[None])
            assert ((got.double() - exact).abs() <= bound * 1.01 + 1e-5).all()
            assert not torch.equal(got.double(), exact)  # really int8
        assert frozen(torch.empty(0, 72, dtype=dtype)).shape == (0, 100)


@needs_vnni
def test_the_vnni_copy_follows_writes_and_goes_where_vnni_does(monkeypatch):
    """The int8 copy is re-made after an in-place write; where VNNI is off the product is F.linear's, exactly."""
    torch.manual_seed(0)
    weight = torch.randn(64, 32)
    frozen = FrozenLinear(weight.clone(), None, KernelPlan(default="vnni"))
    x = torch.randn(3, 32)
    frozen(x)
    with torch.no_grad():
        frozen.weight.mul_(-2)
    expected = F.linear(x, -2 * weight)
    assert (frozen(x) - expected).abs().max() < 0.05 * expected.abs().max()  # a stale copy would be off by 3x
    monkeypatch.setattr(native, "_int8_vnni", False)
    assert not frozen.has_vnni() and torch.equal(frozen(x), expected)
    assert KernelPlan({"a": "vnni", "b": "native"}).summary()["vnni"] == 1


def test_draft_precision_timed_on_a_busier_machine_is_timed_again(tmp_path, monkeypatch):
    """The drafting-precision choice is cached like the kernel plan, and checked like it: the chosen precision timed
    once at load; much faster than recorded means the record was taken under load, and all are timed again."""
    from dflash.methods.base import measured_draft_precision

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_target("llama")
    target.measure = True
    speed = {"float32": 0.020, "bfloat16": 0.040, "int8": 0.010, "int8-head": 0.012}  # seconds a drafting pass takes
    calls = []

    def seconds_in(precision):
        calls.append(precision.name)
        return speed[precision.name]

    chosen, report = measured_draft_precision(target, "m", seconds_in)
    first_choice = min(report["draft_ms"], key=report["draft_ms"].get)
    assert report["measured_now"] and chosen.name == first_choice
    _, report = measured_draft_precision(target, "m", seconds_in)  # the same speed now: kept after one timing
    assert not report["measured_now"] and calls[-1] == first_choice
    speed = {name: seconds / 4 for name, seconds in speed.items()}  # the machine was busy when it was recorded
    _, report = measured_draft_precision(target, "m", seconds_in)
    assert report["measured_now"] and min(report["draft_ms"].values()) == pytest.approx(1000 * min(speed.values()))
    target.model.to(torch.bfloat16)  # the same target in another dtype drafts at other costs: its own record
    _, report = measured_draft_precision(target, "m", seconds_in)
    assert report["measured_now"] and "float32" not in report["draft_ms"]


def test_draft_precisions_are_timed_in_turns_so_a_busy_moment_spoils_none(tmp_path, monkeypatch):
    """Each precision is timed once a turn, turns starting one further along, and its median kept: a busy moment of
    the shared machine during two timings (3x slower) does not hand the choice to a slower precision, as it did when
    each precision was timed once, one after the other (a bfloat16 DFlash drafter, 2.2 ms a round, lost to
    int8-head's 3.7 that way)."""
    from dflash.methods.base import DRAFT_TIMING_TURNS, measured_draft_precision

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_target("llama")
    target.measure = True
    speed = {"float32": 0.020, "bfloat16": 0.012, "int8": 0.014, "int8-head": 0.015}
    calls = []

    def seconds_in(precision):
        calls.append(precision.name)
        busy = 3.0 if len(calls) in (2, 3) else 1.0  # the second and third timings of the first turn
        return busy * speed[precision.name]

    chosen, report = measured_draft_precision(target, "turns", seconds_in)
    assert calls[:4] == ["float32", "bfloat16", "int8", "int8-head"] and calls[4:8] == [
        "bfloat16", "int8", "int8-head", "float32"]
    assert len(calls) == 4 * DRAFT_TIMING_TURNS
    assert chosen.name == "bfloat16" and report["draft_ms"]["bfloat16"] == pytest.approx(12.0)


def test_a_drafting_pass_is_timed_after_a_target_step_as_in_a_round(monkeypatch):
    """In a round the target's step comes first and evicts the drafter's weights from the caches; drafting passes
    timed back to back would favour drafters with more bytes. Each timed pass follows a step, after one untimed
    pass over the context."""
    from dflash.methods.base import best_drafting_seconds
    from dflash.methods.ngram import NgramProposer

    target = tiny_target("llama")
    order = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: order.append("step") or forward(*a, **k))
    proposer = NgramProposer(max_draft=3)
    propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda *a, **k: order.append("draft") or propose(*a, **k))
    assert best_drafting_seconds(proposer, target, context=8, runs=3) >= 0
    assert order == ["draft"] + ["step", "draft"] * 4  # the context, a warm-up, then three timed


def test_a_timed_drafting_pass_reads_a_rounds_new_features_not_the_whole_context(monkeypatch):
    """The pass a round pays reads the few tokens the last round committed; the first pass after a prompt reads
    all of it (64 rows: 3.7 ms against a round's 2.3 for SmolLM2's bfloat16 drafter) and would mislead the choice
    of a draft dtype and the reported draft_ms. Each timed pass drafts after `accepted` new tokens, in order."""
    from dflash.methods.base import best_drafting_seconds
    from dflash.methods.dflash.proposer import DFlashProposer, untrained_drafter

    target = tiny_target("llama")
    proposer = DFlashProposer(untrained_drafter(target, num_layers=1), target)
    backlogs, lengths = [], []
    propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda sequence, *a, **k: backlogs.append(proposer.context_backlog())
                        or lengths.append(len(sequence)) or propose(sequence, *a, **k))
    assert best_drafting_seconds(proposer, target, context=8, accepted=3, runs=3) >= 0
    assert backlogs == [8, 3, 3, 3, 3] and lengths == [9, 12, 15, 18, 21]


def test_a_timing_taken_on_a_busier_machine_is_taken_again(tmp_path, monkeypatch):
    """Relative timings (pass costs, head savings) are cached with the 1-token pass time of their moment: kept while
    today's pass is as slow or slower, measured again when it is much faster (the record was taken under load), and
    an entry without that time (the old format) is measured again too."""
    from dflash.models import target as target_module
    from dflash.models.target import cached_timing

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_target("llama")
    step = {"ms": 40.0}
    monkeypatch.setattr(target_module, "time_pass", lambda *args, **kwargs: step["ms"])
    measured = []

    def measure():
        measured.append(step["ms"])
        return {"value": len(measured)}

    def fresh_process():
        target._step_ms_now = None  # a new process times its pass anew
        return cached_timing(target, "thing", measure)

    assert fresh_process() == {"value": 1, "step_ms": 40.0}
    step["ms"] = 36.0  # a little quieter: within STALE_RATIO, kept
    assert fresh_process()["value"] == 1
    step["ms"] = 15.0  # much quieter now: the record was taken under load
    assert fresh_process() == {"value": 2, "step_ms": 15.0}
    step["ms"] = 60.0  # busier now than then: kept (measuring under load would repeat the mistake)
    assert fresh_process()["value"] == 2
    from dflash.models.kernels import cached_measurement

    cached_measurement(target.measurement_key("old"), lambda: {"value": 0})  # an entry without its pass time
    assert cached_timing(target, "old", measure)["value"] == 3


def test_pass_costs_never_fall_with_width():
    from dflash.control import nondecreasing

    assert nondecreasing([1.0, 1.1, 1.3, 1.6]) == [1.0, 1.1, 1.3, 1.6]
    # a busy moment's reading (seen: a 2-token pass at 2.31x a step, an 8-token one at 1.87x) is pooled with its
    # neighbours, not allowed to make every wider pass as dear as it
    pooled = nondecreasing([1.0, 2.31, 2.29, 1.87, 2.26])
    assert pooled == pytest.approx([1.0, (2.31 + 2.29 + 1.87) / 3, (2.31 + 2.29 + 1.87) / 3, (2.31 + 2.29 + 1.87) / 3,
                                    2.26])
    assert all(a <= b for a, b in zip(pooled, pooled[1:]))


@needs_packing
def test_a_drafter_s_own_shapes_are_measured_into_a_copy_of_the_plan(tmp_path, monkeypatch):
    """`covering` measures only the shapes the target's plan lacks (here the 64x96 one, where plain wins), once
    per machine, and leaves the target's plan and choices as they were; an int8 plan widens its float plan."""
    from dflash.models.kernels import covering, int8_head_plan

    clock = FakeClock()
    timed = []

    def fake_run(self, x, kernel):
        timed.append(self.in_features)
        clock.now += 1.0 if kernel == "plain" else 2.0
        return x

    monkeypatch.setattr(FrozenLinear, "run", fake_run)
    target_plan = KernelPlan({shape_key(64, 32, torch.float32, b): "native" for b in (1, 16, 1 << 30)}, "packed")
    linears = [FrozenLinear(torch.randn(64, 32)), FrozenLinear(torch.randn(64, 96))]
    cache = tmp_path / "plans.json"
    plan = covering(target_plan, linears, "drafter", fingerprint="cpu", cache_file=cache, timer=clock)
    assert set(timed) == {96}  # the target's shape is never timed again
    assert plan.kernel(64, 96, torch.float32, 1) == "plain" and plan.kernel(64, 32, torch.float32, 8) == "native"
    assert target_plan.kernel(64, 96, torch.float32, 1) == "packed"  # the target's plan is untouched
    calls = clock.calls
    covering(target_plan, linears, "drafter", fingerprint="cpu", cache_file=cache, timer=clock)
    assert clock.calls == calls  # cached
    head = int8_head_plan(target_plan)
    widened = covering(head, linears, "drafter", fingerprint="cpu", cache_file=cache, timer=clock)
    assert widened.kernel(64, 96, torch.float32, 1) == "int8"  # int8 where the target has no choice ...
    assert widened.in_float().kernel(64, 96, torch.float32, 1) == "plain"  # ... the measured float kernel in float
    assert widened.kernel(64, 32, torch.float32, 1) == "native"  # the target's shapes keep the target's kernels


def test_int8_head_plan_keeps_the_target_s_kernels_for_its_shapes():
    from dflash.models.kernels import int8_head_plan

    target_plan = KernelPlan({shape_key(64, 32, torch.float32, 16): "native"}, "packed")
    plan = int8_head_plan(target_plan)
    assert plan.kernel(64, 32, torch.float32, 8) == "native"
    assert plan.kernel(64, 32, torch.float32, 1) == "int8" and plan.kernel(1000, 32, torch.float32, 4) == "int8"
    assert plan.in_float() is target_plan


def test_a_process_says_once_that_it_is_timing_the_machine(tmp_path, monkeypatch, capsys):
    """A fresh machine's first run times ~15 things, half a minute or more: the first measurement of a process says
    so on stderr, later ones and cached results do not."""
    from dflash.models import kernels
    from dflash.models.kernels import cached_measurement

    monkeypatch.setattr(kernels, "_announced", False)
    cache = tmp_path / "plans.json"
    assert cached_measurement("a", lambda: {"x": 1}, "machine", cache) == ({"x": 1}, True)
    assert cached_measurement("b", lambda: {"x": 2}, "machine", cache) == ({"x": 2}, True)
    assert cached_measurement("a", lambda: {"x": 3}, "machine", cache) == ({"x": 1}, False)
    err = capsys.readouterr().err
    assert err.count("timing kernels and passes on this machine") == 1 and str(cache) in err
