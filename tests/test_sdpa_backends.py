"""The attention backend chosen by measurement (models/sdpa_backends.py). The choice is made for CUDA devices; here
the CPU stands in for one: the same measurement, the same scoping, torch's CPU backends (math and flash)."""

import pytest
import torch

from dflash.models import sdpa_backends
from dflash.testing import tiny_target


@pytest.fixture(autouse=True)
def no_choice_left():
    saved = dict(sdpa_backends._chosen)
    sdpa_backends._chosen.clear()
    yield
    sdpa_backends._chosen.clear()
    sdpa_backends._chosen.update(saved)


@pytest.fixture
def flags_seen(monkeypatch):
    """Record, for every SDPA call, whether torch's flash backend was allowed (sdpa_kernel sets these flags)."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.flash_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


def test_measure_times_every_candidate_that_runs():
    seconds = sdpa_backends.measure("cpu", torch.float32, heads=4, kv_heads=2, head_dim=16, calls=4)
    assert set(seconds) == set(sdpa_backends.CANDIDATES)
    assert all(s > 0 for s in seconds.values())


def test_a_candidate_whose_backends_cannot_run_is_left_out(monkeypatch):
    real = torch.nn.functional.scaled_dot_product_attention

    def flash_only(*args, **kwargs):
        if not torch.backends.cuda.flash_sdp_enabled():
            raise RuntimeError("No available kernel. Aborting execution.")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", flash_only)
    seconds = sdpa_backends.measure("cpu", torch.float32, heads=4, kv_heads=4, head_dim=16, calls=2)
    assert "math" not in seconds and "default" in seconds


def test_measured_shapes_are_fresh_and_masked_like_decoding():
    calls = list(sdpa_backends._calls(torch.device("cpu"), torch.float32, 4, 2, 8, first_length=10, calls=4))
    lengths = [k.shape[2] - q.shape[2] for q, k, v, mask, gqa in calls]
    assert lengths == [10, 11, 12, 13]  # a new key count at every call
    q, k, v, mask, gqa = calls[1]
    assert q.shape[2] == sdpa_backends.VERIFY_WIDTH and gqa
    # each block query sees the whole context and the block up to itself
    assert mask[0, 0].sum(-1).tolist() == [11 + i + 1 for i in range(sdpa_backends.VERIFY_WIDTH)]


def test_choose_keeps_the_fastest_and_scopes_it_to_its_device(flags_seen):
    report = sdpa_backends.choose(torch.device("cpu"), torch.float32, 4, 2, 16,
                                  seconds={"default": 3e-3, "flash": 2e-3, "math": 1e-3})
    assert report["sdpa"] == "math" and report["ms_per_call"]["flash"] == 2.0
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16)
    sdpa_backends.attention(q, k, k, None, None, True)
    assert flags_seen == [False]  # ran under math alone
    assert torch.backends.cuda.flash_sdp_enabled()  # and only inside the call
    sdpa_backends.use(torch.device("meta"), "flash")  # another device's choice leaves this one's alone
    sdpa_backends.use(torch.device("cpu"), "default")
    sdpa_backends.attention(q, k, k, None, None, True)
    assert flags_seen == [False, True]


def test_unknown_candidate_is_refused():
    with pytest.raises(ValueError, match="unknown SDPA candidate"):
        sdpa_backends.use(torch.device("cpu"), "fastest")


def test_the_target_forward_attends_under_the_choice_with_the_same_result(flags_seen):
    target = tiny_target("llama", num_layers=2)
    target.engine.prompts_in_c_up_to = 0  # a prompt through torch's layers (steps and verify passes run in C)
    ids = torch.randint(0, 64, (1, 40))
    cache = target.engine.new_cache(capacity=64)
    reference, _ = target.engine.forward(ids, cache)
    assert flags_seen and all(flags_seen)
    flags_seen.clear()
    sdpa_backends.use(torch.device("cpu"), "math")
    cache = target.engine.new_cache(capacity=64)
    logits, _ = target.engine.forward(ids, cache)
    assert flags_seen == [False, False]  # both layers
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_a_cuda_targets_load_chooses_attention_through_our_forward_only(monkeypatch):
    """choose_kernels on a CUDA target (the device faked: the choice itself is tested above) measures attention for
    our forward with its head shapes, and leaves a transformers-fallback target alone."""
    from dflash.models.target import TargetModel, choose_kernels

    asked = []
    monkeypatch.setattr(sdpa_backends, "choose", lambda *args: asked.append(args) or {"sdpa": "flash"})
    target = tiny_target("llama")
    fallback = TargetModel(target.model, target.tokenizer, "tiny", prefer_transformers=True, measure=False)
    monkeypatch.setattr(TargetModel, "device", property(lambda self: torch.device("cuda", 0)))
    choose_kernels(target)
    assert target.kernel_report["attention"] == {"sdpa": "flash"}
    device, dtype, heads, kv_heads, head_dim = asked[0]
    attention = target.engine.layers[0].self_attn
    assert (heads, kv_heads, head_dim) == (attention.heads, attention.kv_heads, attention.head_dim)
    choose_kernels(fallback)
    assert len(asked) == 1 and "attention" not in fallback.kernel_report


@pytest.mark.parametrize("gqa", [False, True])
def test_causal_attention_equals_the_mask_of_bools_it_stands_for(gqa):
    """CAUSAL runs SDPA's causal kernel (and, where SDPA cannot run, e.g. soft-capped logits, becomes the lower
    triangle of bools): the same outputs, bitwise on the CPU, as the explicit mask."""
    from dflash.models.layers import softcapped_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=g)
    keys = torch.randn(2, 2 if gqa else 4, 37, 16, generator=g)
    values = torch.randn(keys.shape, generator=g)
    lower = torch.ones(37, 37, dtype=torch.bool).tril()
    causal = sdpa_backends.attention(q, keys, values, sdpa_backends.CAUSAL, 0.25, gqa)
    assert torch.equal(causal, sdpa_backends.attention(q, keys, values, lower, 0.25, gqa))
    assert not torch.allclose(causal, sdpa_backends.attention(q, keys, values, None, 0.25, gqa))
    capped = softcapped_attention(q, keys, values, sdpa_backends.CAUSAL, 0.25, 5.0)
    assert torch.equal(capped, softcapped_attention(q, keys, values, lower, 0.25, 5.0))
