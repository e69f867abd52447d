"""int8 targets (`--dtype int8`, models/target.py quantize_int8): weights rounded per output row, the bfloat16 values
they stand for written into the model, and our kernels reading the int8 bytes (native.c): in pairs (INT8_PAIRS) where
the CPU has AVX512-BF16 and VBMI, widened to float32 (INT8_WIDENED) on AVX2. The product is the pairs kernel's or the
float kernel's chain over the integers, scaled after the sum; verify passes stay bitwise their steps, so speculative
decoding stays exact for the int8 model."""

import pytest
import torch

from conftest import (ARCHS, OracleProposer, RandomProposer, amx_runs_here, pairs_chain, pairs_run_here,
                      wide_pass_and_steps)
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.loading import load_target_cached
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.ngram import NgramProposer
from dflash.models import native
from dflash.models.target import choose_kernels, quantize_int8
from dflash.testing import tiny_target


def int8_runs_here() -> bool:
    return native.int8_kernel() is not None


def int8_pairs_run_here() -> bool:
    lib = native.library()
    return pairs_run_here() and bool(lib.dflash_int8_pairs())


needs_int8 = pytest.mark.skipif(not int8_runs_here(), reason="our kernels do not read int8 weights here")
needs_int8_pairs = pytest.mark.skipif(not int8_pairs_run_here(), reason="no AVX512-BF16 + VBMI here")
needs_library = pytest.mark.skipif(native.library() is None, reason="no kernel library here")


@pytest.fixture(params=["widened", "pairs", "pairs-amx"])
def int8_kernel(request):
    """The int8 kernel `request.param` in force (with the bfloat16 layout it goes with; "pairs-amx": in pairs,
    summed through AMX tiles) for what the test lays out, where this CPU runs it; the old settings restored after.
    Yields the kernel's name ("pairs" for both kinds of pairs)."""
    kernel = request.param.removesuffix("-amx")
    if kernel == "pairs" and not int8_pairs_run_here():
        pytest.skip("no AVX512-BF16 + VBMI here: int8 weights are not read in pairs")
    if request.param == "pairs-amx" and not amx_runs_here():
        pytest.skip("no AMX here: products in pairs do not run through tiles")
    if native.library() is None:
        pytest.skip("no kernel library here")
    old = (native.set_bf16_pairs(kernel == "pairs"), native.set_int8_kernels(True),
           native.set_amx(request.param == "pairs-amx"))
    try:
        assert native.int8_kernel() == kernel
        yield kernel
    finally:
        native.set_bf16_pairs(old[0])
        native.set_int8_kernels(old[1])
        native.set_amx(old[2])


def float_chain(x, weight):
    """The float kernels' sums: each output ONE chain of FMAs over the inputs in order (a product of a bfloat16 and
    an integer in [-127, 127] is exact in float32, so each step rounds once, as an FMA does)."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for j in range(weight.shape[1]):
        acc = acc + xf[:, j: j + 1] * wf[:, j][None]
    return acc


def test_rows_round_to_255_levels_of_their_own_scale():
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(30, 70, generator=g) * torch.logspace(-3, 1, 30)[:, None]).bfloat16()
    weight[3] = 0  # an all-zero row keeps a positive scale and zero weights
    q, scales, approx = native.int8_weights(weight)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scales.dtype == torch.float32
    assert torch.equal(q.abs().amax(dim=1)[[i for i in range(30) if i != 3]], torch.full((29,), 127, dtype=torch.int8))
    assert scales[3] > 0 and not q[3].any() and not approx[3].float().any()
    assert torch.equal(approx, (q.float() * scales[:, None]).bfloat16())
    # each weight within half a level (plus bfloat16's rounding of the level)
    error = (approx.float() - weight.float()).abs()
    assert (error <= 0.5 * scales[:, None] + approx.float().abs() * 2 ** -8 + 1e-30).all()


@needs_library
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("n,k", [(67, 150), (24, 8), (50, 20), (96, 576), (400, 96)])
def test_widened_int8_products_are_the_float_chain_over_the_integers_scaled_after(m, n, k):
    """Every row count (a step four panels at a time, up to 4 rows two at a time, widened a chunk at a time beyond;
    400 outputs are enough panels for a thread's share to hold four) and padded shape: each
    output is the float kernel's one chain over q, times its row's scale, rounded once; with unit scales bitwise the
    widening bfloat16 kernel on bf16(q). AVX2 code: it runs wherever the library does."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    weight = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    q, scales, _ = native.int8_weights(weight)
    tiles = native.int8_widened_tiles(q, scales)
    assert tiles.dtype == torch.int8 and tiles.shape == (-(-n // 24), -(-k // 8) * 8, 24)
    got = native.linear(x, tiles, n, None)
    assert torch.equal(got, (float_chain(x, q) * scales).bfloat16())
    ones = native.linear(x, native.int8_widened_tiles(q, torch.ones(n)), n, None)
    assert torch.equal(ones, native.linear(x, native.tiles(q.bfloat16(), pairs=False), n, None))
    assert torch.equal(got, torch.cat([native.linear(x[i: i + 1], tiles, n, None) for i in range(m)]))


@needs_library
def test_every_byte_value_widens_to_its_integer():
    q = torch.arange(-127, 128, dtype=torch.int8)[: 240].view(24, 10)
    got = native.linear(torch.eye(10).bfloat16(), native.int8_widened_tiles(q, torch.ones(24)), 24, None)
    assert torch.equal(got.float(), q.float().T)


def int8_pair_products(m: int, n: int, k: int, amx: bool) -> dict:
    """A random [n, k] weight's levels q and scales, m random rows x, and through the kernel in pairs (AMX tiles
    or VDPBF16PS chains): their products ("got"), each row's alone ("alone"), with unit scales ("ones"), and the
    bfloat16 product on bf16(q) ("bf16")."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    weight = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    q, scales, _ = native.int8_weights(weight)
    old = native.set_amx(amx)
    try:
        tiles = native.int8_pair_tiles(q, scales)
        return {"x": x, "q": q, "scales": scales, "got": native.linear(x, tiles, n, None),
                "alone": torch.cat([native.linear(x[i: i + 1], tiles, n, None) for i in range(m)]),
                "ones": native.linear(x, native.int8_pair_tiles(q, torch.ones(n)), n, None),
                "bf16": native.linear(x, native.tiles(q.bfloat16(), pairs=True), n, None)}
    finally:
        native.set_amx(old)


@needs_int8_pairs
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("n,k", [(67, 150), (24, 8), (50, 20), (96, 576)])
def test_int8_products_are_the_pairs_chain_over_the_integers_scaled_after(m, n, k):
    """Every row count (in the kernel up to 8 rows, expanded a chunk at a time beyond) and padded shape: each
    output is the pairs kernel's one chain over bf16(q), times its row's scale, rounded once; with unit scales
    bitwise the bfloat16 pairs kernel on bf16(q)."""
    p = int8_pair_products(m, n, k, amx=False)
    assert torch.equal(p["got"], (pairs_chain(p["x"], p["q"].bfloat16()) * p["scales"]).bfloat16())
    assert torch.equal(p["ones"], p["bf16"])
    assert torch.equal(p["got"], p["alone"])


@needs_int8_pairs
@pytest.mark.skipif(not amx_runs_here(), reason="no AMX here")
@pytest.mark.parametrize("m", [1, 2, 9, 16, 17, 33])
@pytest.mark.parametrize("n,k", [(67, 150), (24, 8), (96, 576), (30, 1536)])
def test_int8_products_through_amx_tiles_are_the_bfloat16_tiles_products_over_the_integers(m, n, k):
    """Through AMX tiles int8 weights are expanded to their bfloat16 values a chunk at a time (32 pairs, two
    blocks; over 16 rows, each panel whole first) and summed by the bfloat16 kernel's blocks: with unit scales
    bitwise the bfloat16 product on bf16(q), every row its own, the scales applied after (close to the float32
    product)."""
    p = int8_pair_products(m, n, k, amx=True)
    assert torch.equal(p["ones"], p["bf16"])
    assert torch.equal(p["got"], p["alone"])
    exact = (p["x"].float() @ p["q"].float().T) * p["scales"]
    torch.testing.assert_close(p["got"].float(), exact, rtol=1.6e-2, atol=2e-2)


@needs_int8_pairs
def test_every_byte_value_reads_as_its_integer():
    """All 255 levels, both signs, through the tables: a one-hot input picks each weight out."""
    q = torch.arange(-127, 128, dtype=torch.int8)[: 240].view(24, 10)
    x = torch.eye(10).bfloat16()
    got = native.linear(x, native.int8_pair_tiles(q, torch.ones(24)), 24, None)
    assert torch.equal(got.float(), q.float().T)
    rest = torch.arange(113, 128, dtype=torch.int8).view(15, 1).expand(15, 2).contiguous()
    assert torch.equal(native.linear(torch.ones(1, 2).bfloat16(), native.int8_pair_tiles(-rest, torch.ones(15)), 15,
                                     None).float(), -2 * rest[:, 0].float()[None])


def int8_twins(arch: str):
    """One tiny int8 target twice: through our kernels (int8 tiles where they run here) and through plain torch on
    the bfloat16 values the int8 weights stand for."""
    ours, theirs = (tiny_target(arch, logit_scale=4.0) for _ in range(2))
    for target, kernels in ((ours, "native"), (theirs, "plain")):
        target.model.to(torch.bfloat16)
        quantize_int8(target)
        choose_kernels(target, kernels)
    return ours, theirs


@pytest.mark.parametrize("arch", ARCHS)
def test_an_int8_target_is_the_bfloat16_model_of_its_levels(arch):
    """Both twins hold the same rounded weights (written into transformers' modules too), and their logits agree
    within bfloat16's tolerance through the C layers; the embeddings and the head keep their weights."""
    ours, theirs = int8_twins(arch)
    original = tiny_target(arch, logit_scale=4.0)
    original.model.to(torch.bfloat16)
    assert ours.int8 and ours.precision == "int8"
    for (name, a), (_, b), (_, c) in zip(ours.model.named_parameters(), theirs.model.named_parameters(),
                                         original.model.named_parameters()):
        assert torch.equal(a, b), name
        if "proj" in name and a.dim() == 2:
            assert not torch.equal(a, c), f"{name} was not rounded"
            _, _, again = native.int8_weights(c)
            assert torch.equal(a, again), name
        elif "embed" in name or "norm" in name:
            assert torch.equal(a, c), name
    if int8_runs_here():
        assert ours.engine.layers[0].self_attn.qkv.native_tiles().dtype == torch.int8
    ids = ours.encode_prompt("w20 w31 w9 w9 w40 w12 w3")
    caches = ours.new_cache(), theirs.new_cache()
    ours.forward(torch.tensor([ids]), caches[0])
    theirs.forward(torch.tensor([ids]), caches[1])
    for token in [5, 9, 33, 2, 17]:
        got = ours.forward(torch.tensor([[token]]), caches[0]).logits
        expected = theirs.forward(torch.tensor([[token]]), caches[1]).logits
        assert (got - expected).abs().max() <= 3e-2 * expected.abs().max(), f"after token {token}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_int8_verify_passes_give_bitwise_the_logits_of_steps(arch, int8_kernel):
    target = tiny_target(arch, logit_scale=4.0, hidden_size=128)
    target.model.to(torch.bfloat16)
    quantize_int8(target)
    choose_kernels(target, "native")
    for tokens in (1, 16):  # the C layers run, their four products reading int8
        assert target.engine.layers[0]._native_constants(torch.bfloat16, tokens)[-1] == 1
    assert target.engine.layers[0].self_attn.qkv.native_tiles().dim() == (4 if int8_kernel == "pairs" else 3)
    for width in (4, 9, 16, 33):
        wide, steps = wide_pass_and_steps(target, width)
        assert torch.equal(wide, steps), f"width {width}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_lossless_on_an_int8_target(arch):
    """Speculative decoding with every kind of proposer gives the int8 target's own greedy tokens."""
    target = int8_twins(arch)[0]
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, 2, num_layers=1, block_size=8, num_features=2)
    drafter = DFlashDrafter.untrained(cfg, 0).freeze().to(torch.bfloat16)
    for prompt in ["w1 w2 w3 w4 w5", "w20 w31 w9 w9 w40 w12 w3"]:
        ids = target.encode_prompt(prompt)
        reference = SpeculativeDecoder(target).generate(ids, config)
        for proposer in (DFlashProposer(drafter, target), NgramProposer(max_draft=7),
                         OracleProposer(reference.tokens, len(ids), 7), RandomProposer(target.vocab_size, 7)):
            result = SpeculativeDecoder(target, proposer).generate(ids, config)
            assert result.tokens == reference.tokens, f"{proposer.name} changed the greedy output"


def test_without_int8_kernels_the_same_levels_run_as_bfloat16(int8_kernel):
    """DFLASH_INT8=0 (or a CPU with AVX512-BF16 but without VBMI): the layers read the bfloat16 values of the
    levels, close to the int8 kernel's logits (the scale applied before the sum instead of after)."""
    target = int8_twins("llama")[0]
    ids = target.encode_prompt("w20 w31 w9 w9 w40")
    logits = {}
    for on in (True, False):
        old = native.set_int8_kernels(on)
        try:
            dtype = target.engine.layers[0].self_attn.qkv.native_tiles().dtype
            assert dtype == (torch.int8 if on else torch.bfloat16)
            logits[on] = target.forward(torch.tensor([ids]), target.new_cache()).logits
        finally:
            native.set_int8_kernels(old)
    assert (logits[True] - logits[False]).abs().max() <= 3e-2 * logits[False].abs().max()


def test_a_weight_written_in_place_ends_its_int8_form():
    target = int8_twins("llama")[0]
    qkv = target.engine.layers[0].self_attn.qkv
    assert (qkv.int8_weights() is not None) == int8_runs_here()
    with torch.no_grad():
        qkv.weight.mul_(2)
    assert qkv.int8_weights() is None
    assert qkv.native_tiles() is None or qkv.native_tiles().dtype == torch.bfloat16


def test_int8_needs_a_bfloat16_target_and_a_cpu():
    from dflash.models.target import load_target

    with pytest.raises(ValueError):
        quantize_int8(tiny_target("llama"))  # float32
    with pytest.raises(UserError, match="int8"):  # refused before anything loads
        load_target("smollm2-135m", "int8", device="meta")


def test_the_cli_takes_int8(capsys):
    from dflash.cli import main

    code = main(["generate", "--target", "tiny-llama", "--dtype", "int8", "--method", "ngram", "--max-new-tokens",
                 "16", "--compare-ar", "w1 w2 w3 w1 w2"])
    assert code == 0 and "outputs identical" in capsys.readouterr().err
    target = load_target_cached("tiny-llama", "int8")
    assert target.int8 and target.dtype == torch.bfloat16
    with pytest.raises(UserError, match="unknown dtype"):
        load_target_cached("tiny-llama", "int4")


def test_where_int8_kernels_do_not_run_the_user_is_told(capsys):
    old = native.set_int8_kernels(False) if native.library() is not None else None
    try:
        target = tiny_target("llama")
        target.model.to(torch.bfloat16)
        quantize_int8(target)
        assert "int8 weights run as their bfloat16 values here" in capsys.readouterr().err
    finally:
        if old is not None:
            native.set_int8_kernels(old)


def test_weights_loaded_into_an_int8_target_are_rounded_again():
    """`load_state_dict` into an int8 target: its products are made again from the loaded weights, rounded as an
    int8 target's are (else it would run them unrounded while calling itself int8)."""
    target = int8_twins("llama")[0]
    fresh = tiny_target("llama", logit_scale=4.0, seed=1)
    fresh.model.to(torch.bfloat16)
    target.model.load_state_dict(fresh.model.state_dict())
    qkv = target.engine.layers[0].self_attn.qkv
    _, _, expected = native.int8_weights(fresh.engine.layers[0].self_attn.qkv.weight)
    assert torch.equal(qkv.weight, expected)
    assert (qkv.int8_weights() is not None) == int8_runs_here()
