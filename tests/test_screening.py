"""Greedy tokens through a screen of the LM head (models/screening.py): the float32 head's argmax, bitwise."""

import contextlib

import pytest
import torch

from dflash.models import native, screening
from dflash.models.screening import ScreenedHead, bound_factors

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native kernels: {native.why_not}")


def vnni_runs_here() -> bool:
    return native.library() is not None and bool(native.library().dflash_int8_vnni())


def screen_tiles_run_here() -> bool:
    return native.library() is not None and bool(native.library().dflash_screen_tiles())


@contextlib.contextmanager
def integer_sums(vnni: bool, inputs: str = "dense", tiles: bool = False):
    """The int8 screen's way of summing for the screens made inside: float32 FMAs over widened weights, or integer
    sums (AVX512-VNNI; with `tiles`, of more than one row through AMX tiles) over inputs rounded `inputs`, "dense"
    or "wide", for every number of rows; restored after."""
    if vnni and not vnni_runs_here():
        pytest.skip("no AVX512-VNNI here: the int8 screen sums in float32")
    if tiles and not screen_tiles_run_here():
        pytest.skip("no AMX-INT8 here: the integer screen does not run through tiles")
    old_vnni, old_from = native.set_int8_vnni(vnni), screening.WIDE_FROM
    old_wide = native.set_screen_wide(inputs == "wide") if vnni else native.screen_wide()
    old_tiles = native.set_screen_tiles(tiles)
    screening.WIDE_FROM = 1
    try:
        yield
    finally:
        native.set_int8_vnni(old_vnni)
        native.set_screen_tiles(old_tiles)
        screening.WIDE_FROM = old_from
        if old_vnni:
            native.set_screen_wide(old_wide)


def integer_way(name: str):
    """integer_sums for "dense", "wide", "dense-tiles" or "wide-tiles"."""
    return integer_sums(True, name.split("-")[0], name.endswith("-tiles"))


@pytest.fixture(params=["bfloat16", "int8", "int8-dense", "int8-wide", "int8-dense-tiles", "int8-wide-tiles"])
def kind(request):
    """Each kind of screen, the int8 one five ways: float32 FMAs over its widened weights, and integer sums
    (AVX512-VNNI, where the CPU has it) over inputs rounded dense or wide, by VPDPBUSD or through AMX tiles."""
    if request.param.startswith("int8-"):
        with integer_way(request.param.removeprefix("int8-")):
            yield "int8"
    else:
        with integer_sums(False):
            yield request.param


@pytest.fixture(params=["dense", "wide", "dense-tiles", "wide-tiles"])
def integer_inputs(request):
    """The integer screen (AVX512-VNNI), its inputs dense or wide, summed by VPDPBUSD or through AMX tiles."""
    with integer_way(request.param):
        yield request.param.split("-")[0]


def float32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The float32 head as the engine computes it with our kernel (one FMA chain per logit, in input order)."""
    return native.linear(x, native.tiles(weight), weight.shape[0], None)


def screened_logits(x: torch.Tensor, head: ScreenedHead) -> torch.Tensor:
    """What the screen computes before its bound: bf16(w) . x, or s_i (q_i . x) for int8 (with x rounded to int16
    where it sums in integers: native.c computes those)."""
    if head.vnni:
        return native.int8_vnni_logits(x, head)[0]
    if head.kind == "bfloat16":
        return native.linear(x, native.tiles(head.weight.to(torch.bfloat16).float()), head.weight.shape[0], None)
    quantized = torch.round(head.weight / head.scales[:, None]).clamp(-127, 127)
    return (x.double() @ quantized.double().T * head.scales.double()).float()


@pytest.mark.parametrize("k", [64, 61, 576])  # a width that is not a multiple of 8 pads its inputs
def test_screened_argmax_is_the_float32_heads(kind, k):
    torch.manual_seed(k)
    vocab = 3001
    weight = torch.randn(vocab, k) * 0.05
    head = ScreenedHead(weight, kind)
    x = torch.randn(7, k) * 3
    ids = head.argmax(x)
    logits = float32_logits(x, weight)
    assert torch.equal(ids, logits.argmax(-1))
    assert (head.last_screened >= 1).all() and (head.last_screened < vocab // 20).all()  # a few summed in float32
    for row in range(7):  # one row alone: a step's path (four panels at a time, then two, 126 panels and an odd last)
        assert torch.equal(head.argmax(x[row: row + 1]), ids[row: row + 1])


def test_near_ties_and_exact_ties_are_decided_in_float32(kind):
    """Rows the screen cannot tell apart (equal, or an ulp apart in each weight) all reach the float32 sums, and the
    winner is the one torch's argmax picks: the first of equal largest logits."""
    torch.manual_seed(1)
    k, vocab = 128, 500
    weight = torch.randn(vocab, k) * 0.05
    weight[300] = weight[100]  # an exact tie: 100 must win
    weight[200] = torch.nextafter(weight[100], weight[100].sign() * float("inf"))  # an ulp further from 0 each
    x = weight[100].clone()[None].abs().add(0.01) * torch.sign(weight[100])[None]  # aligned with rows 100/200/300
    head = ScreenedHead(weight, kind)
    ids = head.argmax(x)
    logits = float32_logits(x, weight)
    assert logits[0, 200] > logits[0, 100] == logits[0, 300]  # a hair apart in float32
    assert torch.equal(ids, logits.argmax(-1)) and int(ids) == 200
    assert int(head.last_screened) >= 3
    weight[200] = weight[100]
    head = ScreenedHead(weight, kind)
    assert int(head.argmax(x)) == int(float32_logits(x, weight).argmax(-1)) == 100


def test_rows_closer_than_the_screen_can_tell_apart(kind):
    """Tokens whose logits differ by less than the screen's rounding: its order of them is scrambled, so the winner
    is right only because the bound keeps every one that could win (a screen trusting its own top fails)."""
    torch.manual_seed(3)
    k, vocab = 64, 200
    base = torch.randn(k)
    weight = base + 1e-3 * torch.randn(vocab, k)
    head = ScreenedHead(weight, kind)
    x = base + 0.5 * torch.randn(64, k)
    ids = head.argmax(x)
    assert torch.equal(ids, float32_logits(x, weight).argmax(-1))
    assert (screened_logits(x, head).argmax(-1) != ids).sum() >= 8  # the screen alone would have picked wrong


def test_the_bound_holds_for_every_token(kind):
    """|float32 logit - screened logit| <= the bound, for every token, on inputs with the few huge channels of real
    hidden states: what the screen relies on."""
    torch.manual_seed(2)
    k, vocab = 576, 4000
    weight = torch.randn(vocab, k) * 0.04
    weight[:50] *= torch.rand(50, k) ** 4  # rows with a few large weights: a coarse int8 scale
    x = torch.randn(4, k)
    x[:, 7] *= 200
    head = ScreenedHead(weight, kind)
    exact = float32_logits(x, weight).double()
    approx = screened_logits(x, head).double()
    norm_factor, l1_factor = bound_factors(kind, k)
    bound = norm_factor * x.double().norm(dim=1, keepdim=True) * weight.double().norm(dim=1)
    if head.vnni:  # exact integer sums: the inputs' rounding instead of the chain's (native.c)
        bound = native.int8_vnni_logits(x, head)[1][:, None] * head.bound_norms
    if kind == "int8":
        bound = bound + l1_factor * x.double().abs().sum(dim=1, keepdim=True) * head.scales.double()
    assert ((exact - approx).abs() <= bound).all()
    assert ((exact - approx).abs() > 0.02 * bound).any()  # and it is not loose by orders of magnitude


def test_what_the_screen_refuses(kind):
    weight = torch.randn(50, 16)
    head = ScreenedHead(weight, kind)
    one_inf, one_nan = torch.randn(1, 16), torch.randn(3, 16)
    one_inf[0, 5], one_nan[2, 3] = float("inf"), float("nan")
    for rows in (torch.full((1, 16), float("nan")), one_inf, one_nan):
        assert head.argmax(rows) is None  # a row not finite: the caller computes the logits
    assert head.argmax(torch.randn(1, 8)) is None and head.argmax(torch.randn(1, 16).double()) is None
    with pytest.raises(ValueError, match="screen kind"):
        ScreenedHead(weight, "int4")
    assert not ScreenedHead.applies(weight, torch.zeros(50))
    assert not ScreenedHead.applies(weight.double(), None)
    assert ScreenedHead.applies(weight, None) and ScreenedHead.applies(weight.to(torch.bfloat16), None)


def test_a_bfloat16_heads_rounded_ties(kind, bf16_layout):
    """A bfloat16 head's logits are rounded to bfloat16, so the largest often ties with tokens whose sums were a
    little smaller: the screen keeps every token that could round to the max, and picks the first, as torch's
    argmax over the kernel's logits does. Rows built to tie: the max's neighbours sit within a rounding step. With
    the head in pairs (AVX512-BF16), the tokens that survive are summed as the pairs kernel sums them."""
    torch.manual_seed(5)
    k, vocab = 576, 3001
    weight = (torch.randn(vocab, k) * 0.05).to(torch.bfloat16)
    x = (torch.randn(24, k) * 2).to(torch.bfloat16)
    top = (x.float() @ weight.float().T).argmax(-1)
    for row, token in enumerate(top.tolist()[:8]):  # near-copies of the winner just before it: ties after rounding
        weight[max(0, token - 1 - row % 3)] = (weight[token].float() * (1 - 1e-3 * (row % 2))).to(torch.bfloat16)
    head = ScreenedHead(weight, kind)
    reference = native.linear(x, native.tiles(weight), vocab, None).float()
    ids = head.argmax(x)
    assert torch.equal(ids, reference.argmax(-1))
    tied = [(reference[r] == reference[r].max()).sum().item() for r in range(24)]
    assert max(tied) >= 2  # some rows did tie, and the first of the tied won
    assert head.argmax(x.float()) is None  # a bfloat16 head takes its own dtype's hidden states


@pytest.mark.parametrize("bf16_layout", ["widened"], indirect=True)  # the screen's sums are the head's own
def test_tokens_that_round_to_the_max_are_kept_however_tight_the_bound(bf16_layout):
    """A bfloat16 screen of a bfloat16 head computes its very logits before rounding, so a zero bound is exact
    there; still a token whose sum is a little below the max's can round to the same bfloat16 value, and, first
    in index order, it is the argmax. Only the floor's lowering by a rounding step keeps it."""
    torch.manual_seed(6)
    k, vocab = 64, 240
    weight = (torch.randn(vocab, k) * 0.05).to(torch.bfloat16)
    x = (weight[200].float() * 20).to(torch.bfloat16)[None]  # aligned with token 200: the largest logit
    exact = lambda w: native.linear(x, native.tiles(w), vocab, None).float()[0]  # noqa: E731
    for scale in (0.9995, 0.999, 0.998, 0.997):  # a near-copy before it, a hair smaller: rounds to the same value?
        weight[100] = (weight[200].float() * scale).to(torch.bfloat16)
        logits = exact(weight)
        if logits[100] == logits[200] and not torch.equal(weight[100], weight[200]):
            break
    else:
        pytest.skip("no near-copy rounded to the max's value")
    head = ScreenedHead(weight, "bfloat16")
    head.norm_factor = 0.0  # exact for this head and screen: the screen's sums are the head's own
    assert int(head.argmax(x)) == int(logits.argmax()) == 100


@pytest.mark.parametrize("bf16_layout", ["widened", "pairs"], indirect=True)
def test_survivors_are_summed_as_the_heads_own_kernel_sums_them(kind, bf16_layout):
    """The two bfloat16 kernels (widened FMAs, pairs) round a few sums to neighbouring bfloat16 values. A head
    built on one such sum: token 1 sits on the boundary, token 0 a hair below it (one weight one step smaller), so
    whether token 1 wins or ties (and token 0 wins, first) depends on which chain sums it. The screen must pick
    what the head's own kernel picks."""
    from conftest import pairs_run_here

    if not pairs_run_here():
        pytest.skip("no AVX512-BF16 here: one bfloat16 kernel only")
    torch.manual_seed(7)
    k = 576
    weight, x = (torch.randn(512, k) * 0.05).bfloat16(), torch.randn(64, k).bfloat16()
    widened = native.linear(x, native.tiles(weight, pairs=False), 512, None)
    paired = native.linear(x, native.tiles(weight, pairs=True), 512, None)
    row, token = (widened != paired).nonzero()[0].tolist()
    xr, on_boundary = x[row: row + 1], weight[token].clone()
    below = on_boundary.clone()
    j = int(torch.where((xr[0] > 0) & (below > 0), xr[0].float(), torch.zeros(k)).argmax())
    below.view(torch.int16)[j] -= 1  # a positive weight one bfloat16 step smaller, times a positive input
    head = torch.stack([below, on_boundary])
    own = native.linear(xr, native.tiles(head), 2, None).float()
    other = native.linear(xr, native.tiles(head, pairs=bf16_layout != "pairs"), 2, None).float()
    assert own.argmax(-1) != other.argmax(-1)  # the two chains pick different tokens here
    assert torch.equal(ScreenedHead(head, kind).argmax(xr), own.argmax(-1))


@pytest.mark.parametrize("k", [576, 201])  # in this order: the survivors' panel of a smaller, odd k after a larger
def test_survivors_are_summed_by_the_amx_heads_own_blocks(kind, k):
    """Through AMX tiles a bfloat16 head's sums meet once per block of 16 input pairs, not pair by pair as
    VDPBF16PS adds them; the screen's survivors are gathered into a panel of their own and summed by the same blocks
    (chain_dot_amx8). Heads built on a boundary where the two kernels pick different tokens (as in the test above):
    the screen picks what the tiles pick, and with them off, what the chains pick; also for an odd k (a last pair
    half empty) after a larger one on the same thread (the panel's padding left from it must read as zeros)."""
    from conftest import amx_runs_here

    if not amx_runs_here():
        pytest.skip("no AMX here")
    torch.manual_seed(8)
    weight, x = (torch.randn(4096, k) * 0.05).bfloat16(), torch.randn(64, k).bfloat16()
    old = native.set_bf16_pairs(True), native.set_amx(True)
    try:
        tiles = native.tiles(weight, pairs=True)
        amx = native.linear(x, tiles, 4096, None)
        native.set_amx(False)
        chains = native.linear(x, tiles, 4096, None)
        checked = 0
        for row, token in (amx != chains).nonzero().tolist()[:6 if k == 576 else 40]:
            xr, on_boundary = x[row: row + 1], weight[token].clone()
            below = on_boundary.clone()
            j = int(torch.where((xr[0] > 0) & (below > 0), xr[0].float(), torch.zeros(k)).argmax())
            below.view(torch.int16)[j] -= 1
            head = torch.stack([below, on_boundary])
            picks = {}
            for on in (True, False):
                native.set_amx(on)
                picks[on] = native.linear(xr, native.tiles(head, pairs=True), 2, None).float().argmax(-1)
                assert torch.equal(ScreenedHead(head, kind).argmax(xr), picks[on])
            checked += bool(picks[True] != picks[False])
        assert checked > 0  # some heads did split the two kernels
    finally:
        native.set_bf16_pairs(old[0])
        native.set_amx(old[1])


def test_a_targets_screen_follows_its_head():
    """A target keeps one screen per kind, made again when its head is cast (a bfloat16 head is summed otherwise)
    or its bfloat16 weights are laid out anew."""
    import torch

    from dflash.testing import tiny_target

    target = tiny_target("llama")
    first = target.engine.screen("int8")
    assert first is not None and target.engine.screen("int8") is first
    target.model.to(torch.bfloat16)
    cast = target.engine.screen("int8")
    assert cast is not first and cast.weight.dtype == torch.bfloat16
    assert len([key for key in target.engine.__dict__["_screens"] if key[0] == "int8"]) == 1
    if native.library() is not None and native.library().dflash_bf16_pairs():
        old = native.set_bf16_pairs(not native.bf16_pairs())
        try:
            relaid = target.engine.screen("int8")
            assert relaid is not cast and relaid.bf16_head == (2 if native.bf16_pairs() else 1)
        finally:
            native.set_bf16_pairs(old)


@pytest.mark.parametrize("vocab", [1000, 3001])  # groups of 16 rows: 62.5 and 187.6 of them
def test_every_number_of_rows_the_integer_screen_blocks(vocab, integer_inputs):
    """The VNNI screens run one row as four chains and more rows in even blocks of up to 8 (9 rows: 4 and 5):
    every count gives each row's own argmax, that of the float32 head."""
    torch.manual_seed(vocab)
    k = 96
    weight = torch.randn(vocab, k) * 0.05
    head = ScreenedHead(weight, "int8")
    assert head.vnni
    x = torch.randn(17, k) * 2
    x[:, 11] *= 40  # an outlier channel, as in real hidden states
    expected = float32_logits(x, weight).argmax(-1)
    for rows in (1, 2, 3, 5, 8, 9, 12, 16, 17):
        assert torch.equal(head.argmax(x[:rows]), expected[:rows]), rows


@pytest.mark.skipif(not screen_tiles_run_here(), reason="no AMX-INT8 here")
@pytest.mark.parametrize("inputs", ["dense", "wide"])
@pytest.mark.parametrize("n,k", [(3001, 576), (100, 100), (37, 64), (50, 8)])  # 100: 25 quads, 9 past the tiles
def test_the_screen_through_tiles_is_bitwise_vpdpbusds(n, k, inputs):
    """TDPBSUD adds the byte products VPDPBUSD adds, into int32 sums that are exact in any order: the approximate
    logits and each row's rounding term are bitwise the same, at every row count (16 rows a tile; quads past the
    last whole 16 by VPDPBUSD)."""
    g = torch.Generator().manual_seed(n + k)
    quantized = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01 + 1e-4
    tiles = native.vnni_tiles(quantized)
    old = native.set_screen_tiles(False)
    try:
        for m in (1, 2, 3, 8, 9, 16, 17, 33):
            x = torch.randn(m, k, generator=g)
            x[:, k // 3] *= 40
            sums = []
            for on in (False, True):
                native.set_screen_tiles(on)
                sums.append(native.vnni_product(x, tiles, scales, n, inputs == "wide"))
            assert torch.equal(sums[0][0], sums[1][0]) and torch.equal(sums[0][1], sums[1][1]), m
            exact = (x.double() @ quantized.double().T) * scales.double()  # and near the exact product
            assert (sums[1][0].double() - exact).abs().max() < 0.05 * exact.abs().max()
    finally:
        native.set_screen_tiles(old)


def test_the_integer_screens_input_rounding_is_bounded(integer_inputs):
    """Weights that int8 holds exactly leave the rounding of x to integers as the screen's only error (besides the
    float32 head's own chain): the bound's term for it, which native.c measures row by row, must hold for every
    token, and be near what it bounds (dropping it fails the first assertion)."""
    torch.manual_seed(4)
    k, vocab = 576, 2000
    quantized = torch.randint(-127, 128, (vocab, k)).float()
    quantized[:, 0] = 127  # each row's scale exactly 2^-9: w = s q holds with no rounding
    weight = quantized * 2.0**-9
    x = torch.randn(6, k)
    x[:, 3] *= 300
    head = ScreenedHead(weight, "int8")
    assert torch.equal(head.scales, torch.full((vocab,), 2.0**-9))
    approx, spread = native.int8_vnni_logits(x, head)
    exact = float32_logits(x, weight).double()
    chain = 127 * bound_factors("int8", k)[0] * x.double().abs().sum(dim=1, keepdim=True) * head.scales.double()
    error = (exact - approx.double()).abs()
    assert (error <= spread[:, None] * head.bound_norms + chain).all()
    assert (error > 0.05 * spread[:, None] * head.bound_norms).any()


def test_integer_sums_at_the_edge_of_int32(integer_inputs):
    """The inputs' integer scale grows with k so that 127 x max|x_q| x k stays below 2^31: a row of +-127 weights
    all aligned with x (k = 4100, the largest sum the int16 layout can make) is summed exactly, not wrapped."""
    k = 4100
    sign = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    weight = torch.stack([sign * 0.1, sign * 0.1 * 0.999, -sign * 0.1, torch.zeros(k)])
    x = sign[None] * 2.5
    head = ScreenedHead(weight, "int8")
    approx, _ = native.int8_vnni_logits(x, head)
    assert approx[0, 0] > 0 and torch.allclose(approx[0, :3].double(), float32_logits(x, weight)[0, :3].double(),
                                               rtol=1e-3)
    assert int(head.argmax(x)) == 0


def test_the_byte_screen_keeps_its_wide_channels(vocab=3001):
    """Inputs in bytes give all but a row's 8 largest channels a byte; those add their high bytes apart, a list of
    quads a row. Rows with more wide channels than that (the scale rises to the 9th), two in one quad, one in the
    last, partial quad (k = 61), of either sign and up to the int16 limit: every argmax is the float32 head's, and on
    states like real ones (a few channels 10-60x the rest) few tokens reach the float32 sums."""
    torch.manual_seed(8)
    with integer_sums(True, "wide"):
        for k in (61, 576):
            weight = torch.randn(vocab, k) * 0.05
            head = ScreenedHead(weight, "int8")
            assert head.vnni and head.wide_inputs(1)
            x = torch.randn(6, k)
            x[0, :12] *= 50  # twelve wide channels: more than a row's list holds
            x[1, 4], x[1, 5], x[1, k - 1] = 80.0, -60.0, 45.0  # two in one quad, one in the last
            x[2, 3] = 1e7  # n at the int16 limit, its high byte the largest
            x[3, 9] *= 1e-30  # tiny values round to zero
            x[4:, 2] *= 30
            x[4:, 7] *= -15
            ids = head.argmax(x)
            assert torch.equal(ids, float32_logits(x, weight).argmax(-1)), k
            assert (head.last_screened[[1, 3, 4, 5]] < vocab // 20).all()


def test_dense_inputs_sum_exactly_on_the_int16_scale():
    """Dense inputs: every channel n_j = lo_j + 256 hi_j on the scale max|x| / N_MAX (N_MAX = 2^31 / (127 k) = 29356
    for k = 576). Inputs that scale holds exactly, and weights int8 holds exactly, leave only the float32 rounding of
    the final product: the integer sums of both bytes' streams, minus the offset, must be exact."""
    torch.manual_seed(10)
    k, vocab, limit = 576, 1000, 2**31 // (127 * 576)
    quantized = torch.randint(-127, 128, (vocab, k)).float()
    quantized[:, 0] = 127  # each row's scale exactly 2^-9
    weight = quantized * 2.0**-9
    n = torch.randint(-limit, limit + 1, (5, k)).float()
    n[:, 5] = limit  # the largest magnitude: the scale is exactly 2^-10
    x = n * 2.0**-10
    with integer_sums(True, "dense"):
        head = ScreenedHead(weight, "int8")
        for rows in (1, 5):  # one row's own kernel, and a block
            approx, _ = native.int8_vnni_logits(x[:rows], head)
            exact = (n[:rows].double() @ quantized.double().T) * 2.0**-19
            assert torch.allclose(approx.double(), exact, rtol=2**-22, atol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # Gemma's norm: a unit offset, the product before rounding
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_final_norm_taken_inside_the_screen_gives_the_logits_argmax(arch, dtype, kind):
    """A greedy token takes the final norm and the screen in one C call; its rows are bitwise those `norm.rows`
    gives the logits (the same C function), so the token is the argmax of the logits the engine computes from the
    same hidden states, whichever way they come; and the C norm is torch's RMSNorm within rounding."""
    from dflash.testing import tiny_target

    target = tiny_target(arch, logit_scale=4.0)
    target.model.to(dtype)
    engine = target.engine
    with torch.no_grad():
        engine.norm.weight.uniform_(-0.5, 1.5, generator=torch.Generator().manual_seed(1))
    h = (torch.randn(3, 5, engine.norm.weight.shape[0], generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    normed = engine.norm.rows(h)
    assert normed.dtype == dtype and torch.allclose(normed.float(), engine.norm(h).float(), rtol=1e-2, atol=1e-2)
    if dtype == torch.bfloat16:  # the torch norm's rounding, its sums apart: most values bitwise
        assert (normed == engine.norm(h)).float().mean() > 0.9
    screen = engine.screen(kind)
    ids = screen.argmax(h, engine.norm)
    assert ids is not None and ids.shape == (3, 5)
    assert torch.equal(ids, screen.argmax(normed))
    assert torch.equal(ids, engine.logits(h, "all").argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_screen_made_a_few_rows_at_a_time_is_bitwise_the_whole_calls(dtype, monkeypatch):
    """int8_rows and the row norms go ROWS_AT_ONCE rows at a time (a float64 or float32 copy of a whole head had
    raised a generation's peak memory): the scales, integers and norms are bitwise what one call gives."""
    torch.manual_seed(0)
    head = (torch.randn(1000, 96) * torch.rand(1000, 1)).to(dtype)
    head[7] = 0  # a zero row: the smallest scale
    assert all(torch.equal(a, b) for a, b in zip(native.int8_rows(head, rows_at_once=64),
                                                   native.int8_rows(head, rows_at_once=1 << 30)))
    monkeypatch.setattr(screening, "ROWS_AT_ONCE", 64)
    assert torch.equal(screening.by_rows(head, lambda rows: rows.double().norm(dim=1)), head.double().norm(dim=1))
