"""Packed oneDNN linears (packed.py): the same products as F.linear, a fallback wherever they do not apply, and a
packed target that still decodes token-identically with every proposer."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ARCHS, OracleProposer, RandomProposer
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.packed import FrozenLinear, pack_linears, packing_enabled
from dflash.proposers import DFlashProposer, NgramProposer
from dflash.testing import tiny_target
from test_engine import make_drafter

needs_packing = pytest.mark.skipif(not packing_enabled(), reason="this PyTorch build has no oneDNN linear packing")


@needs_packing
@pytest.mark.parametrize("rows", [1, 2, 17, 100])
def test_float32_product_matches_f_linear(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 96), torch.randn(300)
    frozen = FrozenLinear(weight, bias)
    assert frozen.packed is not None
    x = torch.randn(rows, 96)
    torch.testing.assert_close(frozen(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, rows, 96)  # batched [B, T, D] inputs keep their shape
    assert frozen(x3).shape == (2, rows, 300)
    torch.testing.assert_close(frozen(x3), F.linear(x3, weight, bias), rtol=1e-5, atol=1e-4)


@needs_packing
@pytest.mark.parametrize("rows", [1, 15, 200])  # 200 rows: above BF16_MAX_PACKED_ROWS, the F.linear path
def test_bfloat16_product_matches_f_linear(rows):
    torch.manual_seed(0)
    weight = torch.randn(300, 96).bfloat16()
    frozen = FrozenLinear(weight)
    x = torch.randn(rows, 96).bfloat16()
    torch.testing.assert_close(frozen(x).float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


def test_falls_back_where_the_packed_kernel_does_not_apply():
    torch.manual_seed(0)
    weight = torch.randn(8, 4)
    frozen = FrozenLinear(weight)
    x = torch.randn(3, 4, requires_grad=True)
    frozen(x).sum().backward()  # autograd: the F.linear path, so gradients exist and are exact
    torch.testing.assert_close(x.grad, weight.sum(0).expand(3, 4))
    half = FrozenLinear(weight.half())  # float16 is never packed
    assert half.packed is None
    torch.testing.assert_close(half(x.detach().half()).float(), F.linear(x.detach(), weight), rtol=1e-2, atol=1e-2)
    # an input of another dtype than the weight goes to F.linear, which then raises as it always did
    with pytest.raises(RuntimeError):
        frozen(x.detach().double())


def test_env_switch_turns_packing_off(monkeypatch):
    monkeypatch.setenv("DFLASH_PACKED", "0")
    assert not packing_enabled()
    layer = nn.Linear(4, 8)
    assert pack_linears(nn.Sequential(layer)) == 0
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_packing
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_target_is_lossless_and_close_to_the_plain_one(arch):
    plain, packed = tiny_target(arch, logit_scale=4.0), tiny_target(arch, logit_scale=4.0)
    linears = sum(isinstance(m, nn.Linear) for m in packed.model.modules())
    assert packed.pack_linears() == linears
    ids = packed.encode_prompt("w20 w31 w9 w9 w40 w12 w3")
    with torch.no_grad():
        expected = plain.model(torch.tensor([ids])).logits
        got = packed.model(torch.tensor([ids])).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    reference = SpeculativeDecoder(packed).generate(ids, config)
    drafter = make_drafter(packed, 8)
    pack_linears(drafter)
    for proposer in (DFlashProposer(drafter, packed), NgramProposer(max_draft=7),
                     RandomProposer(packed.vocab_size, 7), OracleProposer(reference.tokens, len(ids), 7)):
        result = SpeculativeDecoder(packed, proposer).generate(ids, config)
        assert result.tokens == reference.tokens, f"{proposer.name} changed the packed target's greedy output"
