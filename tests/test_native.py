"""Our AVX2 kernel (models/native.py, native.c): the same products as F.linear for every shape the panels
pad (rows not a multiple of 24, columns not a multiple of 8), 1-16 input rows (every 1-4 row kernel),
float32 and bfloat16, with and without bias; a layout that follows in-place writes; plans that pick it when it is
faster; greedy output unchanged through it; and the fallback where it cannot be built."""

import platform

import pytest
import torch
import torch.nn.functional as F

from conftest import amx_runs_here, pairs_chain, pairs_run_here, wide_pass_and_steps
from dflash.models import native
from dflash.models.kernels import NATIVE, FrozenLinear, measure_plan, shape_key

needs_native = pytest.mark.skipif(native.library() is None, reason=f"no native kernel here: {native.why_not}")


@pytest.fixture(params=["float32", "bfloat16", "bfloat16-pairs", "bfloat16-amx"])
def dtype(request):
    """The model dtype of a test, bfloat16 once per layout of its weights and kernel (widened; in pairs through
    VDPBF16PS where the CPU has AVX512-BF16; in pairs through AMX tiles where it has AMX), restored after."""
    if request.param == "bfloat16-pairs" and not pairs_run_here():
        pytest.skip("no AVX512-BF16 here: bfloat16 products in pairs do not run")
    if request.param == "bfloat16-amx" and not amx_runs_here():
        pytest.skip("no AMX here: products in pairs do not run through tiles")
    old = None
    if native.library() is not None:
        old = (native.set_bf16_pairs(request.param in ("bfloat16-pairs", "bfloat16-amx")),
               native.set_amx(request.param == "bfloat16-amx"))
    try:
        yield torch.float32 if request.param == "float32" else torch.bfloat16
    finally:
        if old is not None:
            native.set_bf16_pairs(old[0])
            native.set_amx(old[1])


def reference(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 16, 17, 37])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 3), (7, 13), (25, 17), (64, 40), (96, 576), (50, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_product_matches_f_linear(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    weight, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    got = FrozenLinear(weight, bias, NATIVE)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x, weight, bias), rtol=1e-4, atol=1e-4)  # float32 sums, any order


@pytest.fixture(params=sorted(native.NARROW_PASSES))
def narrow_way(request):
    """Each way narrow products read the panels (native.narrow_passes: two panels up to 4 rows, or one panel with
    the next chunk requested), restored after."""
    if native.library() is None:
        pytest.skip(f"no native kernel here: {native.why_not}")
    old = native.set_narrow_passes(request.param)
    try:
        yield request.param
    finally:
        native.set_narrow_passes(old)


@pytest.fixture(params=native.F32_KERNELS)
def f32_kernel(request):
    """Each kernel for float32 panels this CPU runs (native.f32_kernel: AVX2; AVX-512VL in 256-bit and in 512-bit
    code where it has AVX-512VL), restored after."""
    if request.param not in native.f32_kernels_here():
        pytest.skip(f"this CPU does not run the {request.param} kernel")
    old = native.set_f32_kernel(request.param)
    try:
        yield request.param
    finally:
        native.set_f32_kernel(old)


@needs_native
@pytest.mark.parametrize("m", [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 16])
def test_float32_rows_give_bitwise_the_products_of_single_rows(m, narrow_way, f32_kernel):
    """However the rows are grouped (two panels at a time up to 4 rows; groups of 4, or of up to 8 in AVX-512
    registers where the CPU has them, evened out where the last group would be under half full), each output is
    the one chain of FMAs a single row's product makes: verifying k tokens gives bitwise the logits of k steps."""
    g = torch.Generator().manual_seed(m)
    weight, x = torch.randn(75, 150, generator=g), torch.randn(m, 150, generator=g)
    tiles = native.tiles(weight)
    got = native.linear(x, tiles, 75, None)
    assert torch.equal(got, torch.cat([native.linear(x[i: i + 1], tiles, 75, None) for i in range(m)]))


@needs_native
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [8, 150, 576])  # 150, 576: past a chunk of 64 inputs, whose sums are carried over
def test_every_float32_kernel_sums_bitwise_alike(dtype_name, k):
    """256-bit and 512-bit code (native.f32_kernel) hold a panel's columns in different registers but sum each
    output as the same one chain, so the choice between them, made per machine by a timing, never changes a bit:
    float32 products and widened bfloat16 ones (5 rows on), at every row count."""
    here = native.f32_kernels_here()
    if len(here) < 2:
        pytest.skip("one float32 kernel runs here")
    g = torch.Generator().manual_seed(k)
    weight = torch.randn(100, k, generator=g)
    old_pairs = native.set_bf16_pairs(False) if native.bf16_pairs() else False
    old = native.f32_kernel()
    try:
        if dtype_name == "bfloat16":
            weight = weight.bfloat16()
        tiles = native.tiles(weight)
        for m in (1, 2, 3, 5, 8, 9, 13, 16, 17):
            x = torch.randn(m, k, generator=g).to(weight.dtype)
            outputs = []
            for name in here:
                native.set_f32_kernel(name)
                outputs.append(native.linear(x, tiles, 100, None))
            assert all(torch.equal(out, outputs[0]) for out in outputs[1:]), m
    finally:
        native.set_f32_kernel(old)
        native.set_bf16_pairs(old_pairs)


def test_float32_kernels_are_named_and_checked():
    if native.library() is None:
        with pytest.raises(RuntimeError, match="do not run"):
            native.set_f32_kernel("avx2")
        return
    assert native.f32_kernel() in native.f32_kernels_here()
    with pytest.raises(ValueError, match="one of avx2, avx512, avx512-zmm"):
        native.set_f32_kernel("sse")
    if native.f32_kernels_here() == ["avx2"]:
        with pytest.raises(RuntimeError, match="AVX-512VL"):
            native.set_f32_kernel("avx512-zmm")
        assert native.f32_kernel() == "avx2"


@needs_native
@pytest.mark.parametrize("m", [2, 3, 5, 9, 16])
def test_bfloat16_steps_give_bitwise_the_rows_of_wider_products(m, bf16_layout, narrow_way):
    """A step's row against four panels at once (widened bfloat16, where a thread's share holds four: 400 outputs are
    17 panels), two at a time, or in pairs: each output is the one chain its row makes in any wider product."""
    g = torch.Generator().manual_seed(m)
    weight, x = torch.randn(400, 150, generator=g).bfloat16(), torch.randn(m, 150, generator=g).bfloat16()
    tiles = native.tiles(weight)
    got = native.linear(x, tiles, 400, None)
    assert torch.equal(got, torch.cat([native.linear(x[i: i + 1], tiles, 400, None) for i in range(m)]))


@needs_native
def test_threads_never_change_a_product_even_from_concurrent_callers(dtype):
    """Which thread computes an output never changes it: 1-3 threads, and eight Python threads calling at once (one
    holds the thread region, the others run on their own thread), all give bitwise the one-thread result."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(1000, 576, generator=g).to(dtype), torch.randn(16, 576, generator=g).to(dtype)
    layer = FrozenLinear(weight, None, NATIVE)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(layer(x), alone)
        with ThreadPoolExecutor(8) as callers:
            together = list(callers.map(lambda _: layer(x), range(32)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(result, alone) for result in together)


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 18, 36])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_product_is_the_float32_sum_rounded_once(m, with_bias, bf16_layout):
    """Every path of a bf16 product: one to four rows (two panels at a time, two rows at a time, then the odd
    third; widened in the kernel; past two rows in chunks of 64, 64 and 24 of the 152 padded inputs), more (each chunk
    widened once)."""
    g = torch.Generator().manual_seed(m)
    weight, x = torch.randn(67, 150, generator=g).bfloat16(), torch.randn(1, m, 150, generator=g).bfloat16()
    bias = torch.randn(67, generator=g).bfloat16() if with_bias else None
    got = FrozenLinear(weight, bias, NATIVE)(x)
    assert got.shape == (1, m, 67) and got.dtype == torch.bfloat16
    exact = reference(x, weight, bias)
    # only the order of float32 additions differs from the exact sum: the result is its bf16 rounding, give or
    # take one unit in the last place where the sum sits near a rounding boundary
    ulp = exact.abs().clamp_min(1e-3) * 2.0**-7
    assert ((got.float() - exact).abs() <= ulp).all()


@needs_native
def test_bfloat16_rounding_is_to_nearest_even(bf16_layout):
    # x = 1 and a single weight: the product is the weight itself, exactly representable; bias pushes the float32
    # sum to exact halfway points between bf16 neighbours
    weight = torch.ones(4, 1, dtype=torch.bfloat16)
    bias = torch.tensor([0.0, 2.0**-8, 3 * 2.0**-8, -(2.0**-8)], dtype=torch.float32)
    # bias is bf16 too: these offsets are exactly representable there
    got = native.linear(torch.ones(1, 1, dtype=torch.bfloat16), native.tiles(weight), 4, bias.bfloat16())
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1); 1 + 3 * 2^-8 ties up to 1 + 2^-6 (even)
    assert got.float().tolist() == [[1.0, 1.0, 1.0 + 2.0**-6, 1.0 - 2.0**-8]]


@needs_native
def test_layout_follows_in_place_writes():
    lin = FrozenLinear(torch.randn(8, 16), None, NATIVE)
    x = torch.randn(1, 16)
    lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


@needs_native
def test_tiles_are_panels_of_24_rows_stored_column_by_column():
    weight = torch.arange(30 * 9, dtype=torch.float32).view(30, 9)
    tiles = native.tiles(weight)
    assert tiles.shape == (2, 16, 24)  # 30 -> 48 rows (2 panels), 9 -> 16 columns
    assert tiles[0, 3].tolist() == weight[:24, 3].tolist()  # panel 0, input 3: the 24 rows' weights side by side
    assert tiles[1, 8].tolist() == weight[24:, 8].tolist() + [0.0] * 18  # rows 30-47 do not exist: zeros
    assert tiles[:, 9:].abs().sum() == 0  # columns 9-15: padding


@needs_native
def test_bfloat16_tiles_in_pairs_keep_two_inputs_of_a_column_together():
    weight = torch.arange(30 * 9, dtype=torch.float32).view(30, 9).bfloat16()
    tiles = native.tiles(weight, pairs=True)
    assert tiles.shape == (2, 8, 24, 2) and native.tile_inputs(tiles) == 16
    assert tiles[0, 1, :, 0].tolist() == weight[:24, 2].tolist()  # pair 1 = inputs 2 and 3, for each of 24 rows
    assert tiles[0, 1, :, 1].tolist() == weight[:24, 3].tolist()
    assert tiles[:, 5:].float().abs().sum() == 0 and tiles[1, :, 6:].float().abs().sum() == 0  # padding
    assert native.tiles(weight, pairs=False).shape == (2, 16, 24)
    assert native.tiles(weight.float(), pairs=True).shape == (2, 16, 24)  # float32 never pairs


@needs_native
@pytest.mark.skipif(not pairs_run_here(), reason="no AVX512-BF16 here")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 18])
def test_pairs_sum_each_output_as_one_chain_whatever_the_rows(m):
    """Every row count (one group of up to 8 rows, requesting the next chunk from 7 rows; groups of up to 8 beyond,
    evened out where the last would hold under 4: 9 as 5 + 4, 11 as 6 + 5, 17 as 6 + 6 + 5) sums each output as
    the one documented chain of pairs, so a verify pass of k tokens gives bitwise the products of k steps; 150
    inputs pad to 152 (a last pair of zeros, then three more)."""
    g = torch.Generator().manual_seed(m)
    weight, x = (torch.randn(67, 150, generator=g) * 0.1).bfloat16(), torch.randn(m, 150, generator=g).bfloat16()
    tiles = native.tiles(weight, pairs=True)
    amx = native.set_amx(False)
    try:
        got = native.linear(x, tiles, 67, None)
        assert torch.equal(got, pairs_chain(x, weight).bfloat16())
        assert torch.equal(got, torch.cat([native.linear(x[i: i + 1], tiles, 67, None) for i in range(m)]))
    finally:
        native.set_amx(amx)


@needs_native
@pytest.mark.skipif(not amx_runs_here(), reason="no AMX here")
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 15, 16, 17, 18, 33])
@pytest.mark.parametrize("k", [8, 24, 32, 150, 576, 1536])
def test_amx_rows_give_bitwise_the_products_of_single_rows(m, k):
    """Through AMX tiles (up to 16 rows a tile, a row count's own tile configuration, the inputs in blocks of 16
    pairs with a zero-padded last block: k = 8 and 24 end in a part block, 150 pads to 152 first), each output is
    its row's alone, so a verify pass of k tokens gives bitwise the products of k steps; the sums are the float32
    product's within bfloat16 rounding."""
    g = torch.Generator().manual_seed(m * 100 + k)
    weight, x = (torch.randn(67, k, generator=g) * 0.1).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    tiles = native.tiles(weight, pairs=True)
    amx = native.set_amx(True)
    try:
        got = native.linear(x, tiles, 67, None)
        assert torch.equal(got, torch.cat([native.linear(x[i: i + 1], tiles, 67, None) for i in range(m)]))
    finally:
        native.set_amx(amx)
    torch.testing.assert_close(got.float(), reference(x, weight, None), rtol=1.6e-2, atol=1e-2)


@needs_native
@pytest.mark.skipif(not amx_runs_here(), reason="no AMX here")
def test_amx_sums_differ_from_vdpbf16ps_chains_and_do_not_depend_on_a_column_place():
    """TDPBF16PS meets the sum once per block of 16 pairs where VDPBF16PS adds pair by pair (so a model runs one
    kernel or the other, never both); and an output's sum does not depend on where its weight row sits in a panel
    (columns 0-15 and 16-23 are separate tiles), which the screen's survivors (chain_dot_amx8) rely on. Rows of
    random inputs, head rows shifted by 1-23 places."""
    g = torch.Generator().manual_seed(3)
    weight, x = (torch.randn(4096, 576, generator=g) * 0.05).bfloat16(), torch.randn(64, 576, generator=g).bfloat16()
    amx = native.set_amx(True)
    try:
        tiles = native.tiles(weight, pairs=True)
        got = native.linear(x, tiles, 4096, None)
        for shift in range(1, 24):
            shifted = torch.cat([torch.zeros(shift, 576).bfloat16(), weight[:48]])
            moved = native.linear(x, native.tiles(shifted, pairs=True), 48 + shift, None)[:, shift:]
            assert torch.equal(moved, got[:, :48])
        native.set_amx(False)
        chains = native.linear(x, tiles, 4096, None)
    finally:
        native.set_amx(amx)
    assert 0 < (chains != got).sum() < 300  # bfloat16 outputs: 35 of 262,144 round apart


@needs_native
def test_plan_picks_native_when_it_measures_faster(monkeypatch):
    clock = [0.0]

    def fake_run(self, x, kernel):
        clock[0] += {"native": 1.0, "packed": 2.0, "plain": 3.0}[kernel] if x.shape[0] == 1 else 1.0
        return x

    monkeypatch.setattr(FrozenLinear, "run", fake_run)
    linears = [FrozenLinear(torch.randn(64, 32)) for _ in range(2)]
    plan = measure_plan(linears, rows=(1, 8), timer=lambda: clock[0])
    assert plan.choices[shape_key(64, 32, torch.float32, 1)] == "native"
    assert plan.choices[shape_key(64, 32, torch.float32, 16)] == "packed"  # a tie keeps the default
    assert set(plan.timings_ms[shape_key(64, 32, torch.float32, 1)]) == {"plain", "packed", "native"}


def test_without_the_library_native_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", True)
    lin = FrozenLinear(torch.randn(6, 10), torch.randn(6), NATIVE)
    assert "native" not in lin.kernels() and lin.native_tiles() is None
    x = torch.randn(3, 10)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("DFLASH_NATIVE", "0")
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is None and native.why_not == "DFLASH_NATIVE=0"


def test_a_failed_build_is_reported(monkeypatch, capsys, tmp_path):
    """Where the CPU could run our kernels but they cannot be built (a compiler without OpenMP, a broken source),
    the user is told once, on stderr, rather than left with torch's kernels several times slower."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or not native._cpu_has_avx2_fma():
        pytest.skip("our kernels are not for this CPU")
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: broken on purpose' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))  # no library built before
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "why_not", "")
    assert native.library() is None and native.why_not.startswith("build failed")
    assert "our CPU kernels are not running here (build failed" in capsys.readouterr().err
    monkeypatch.setenv("DFLASH_NATIVE", "0")  # a deliberate choice: no word
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is None and capsys.readouterr().err == ""


def test_the_kernels_build_wherever_they_can_run():
    """Every other test here skips without the library, so a compile error in native.c (a new intrinsic an older
    compiler lacks) would leave the suite green and the engine on torch's kernels: where the CPU has AVX2 and FMA
    and there is a C compiler, the library must load."""
    import os
    import platform
    import shutil

    if (os.environ.get("DFLASH_NATIVE", "1") == "0" or platform.system() != "Linux"
            or platform.machine() not in ("x86_64", "AMD64") or not native._cpu_has_avx2_fma()
            or not shutil.which(os.environ.get("CC", "cc"))):
        pytest.skip("the kernels are not built on this machine by design")
    assert native.library() is not None, native.why_not



def test_the_source_is_native_c_with_each_part_in_place_of_its_include():
    """source_text puts each part where native.c includes it (the include line's comment goes too, the part's
    trailing blank lines are cut), the parts of another revision through `read` (scripts/native_source.py)."""
    files = {"native.c": b'#include <stdint.h>\na\n#include "native/x_1.c"  /* why */\nb\n#include "native/y.c"\n',
             "native/x_1.c": b"X\n\n", "native/y.c": b"Y1\nY2\n"}
    assert native.source_text(files.__getitem__) == b"#include <stdint.h>\na\nX\nb\nY1\nY2\n"


def test_every_part_of_the_source_is_built_once_and_keys_the_build(tmp_path, monkeypatch):
    """native.c includes every file of native/ exactly once (a part left out of the build would be dead code, one
    included twice a compile error), the whole text is what the compiler reads (the same tokens from the one
    flattened file as from native.c and its parts), and a change to any part changes the cached library's key."""
    import os
    import shutil
    import subprocess

    folder = native.SOURCE.parent
    included = [m[1].decode() for m in native.PART.finditer(native.SOURCE.read_bytes())]
    parts = sorted(str(path.relative_to(folder)) for path in (folder / "native").glob("*.c"))
    assert sorted(included) == parts and len(set(included)) == len(included) > 1
    text = native.source_text()
    assert b'#include "native/' not in text
    assert all((folder / part).read_bytes().rstrip(b"\n") in text for part in parts)
    if compiler := shutil.which(os.environ.get("CC", "cc")):
        flat = tmp_path / "flat.c"
        flat.write_bytes(text)
        tokens = lambda path: [line for line in subprocess.run(  # noqa: E731
            [compiler, "-E", "-P", *native.FLAGS[:4], str(path)], capture_output=True, text=True, check=True
        ).stdout.splitlines() if line.strip()]
        assert tokens(flat) == tokens(native.SOURCE)
    key = native.build_key("cc 1")
    copy = tmp_path / "copy"
    shutil.copytree(folder / "native", copy / "native")
    shutil.copy(native.SOURCE, copy / "native.c")
    monkeypatch.setattr(native, "SOURCE", copy / "native.c")
    assert native.build_key("cc 1") == key and native.build_key("cc 2") != key
    last = copy / parts[-1]
    last.write_bytes(last.read_bytes() + b"/* changed */\n")
    assert native.build_key("cc 1") != key

# ---- the one-token decoder layer ------------------------------------------------------------------------------------
from conftest import ARCHS  # noqa: E402
from dflash.models.target import choose_kernels  # noqa: E402
from dflash.testing import tiny_target  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # of the largest logit: bf16 keeps 8 bits


def count_layer_calls(monkeypatch) -> list[int]:
    """Layers run in C, whether one call each (native.layer) or all in one (native.stack)."""
    calls = [0]
    real_layer, real_stack = native.layer, native.stack

    def one(*args):
        calls[0] += 1
        return real_layer(*args)

    def every(h, layers, *args):
        calls[0] += len(layers)
        return real_stack(h, layers, *args)

    monkeypatch.setattr(native, "layer", one)
    monkeypatch.setattr(native, "stack", every)
    return calls


def native_and_torch_twins(arch: str, dtype: torch.dtype, head_dim: int = 16):
    """The same tiny target twice: through our kernels and C layers, and through plain torch (the reference)."""
    ours, theirs = (tiny_target(arch, logit_scale=4.0, hidden_size=4 * head_dim) for _ in range(2))
    for target, kernels in ((ours, "native"), (theirs, "plain")):
        target.model.to(dtype)
        choose_kernels(target, kernels)
    return ours, theirs


@needs_native
@pytest.mark.parametrize("arch", ARCHS)
def test_one_token_layers_match_the_torch_forward(arch, dtype, monkeypatch):
    """Decode steps through the C layer (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms, Gemma3 with
    unit-offset and sandwich norms, GELU and two RoPE tables) give the logits and the cached keys/values of the
    torch forward."""
    ours, theirs = native_and_torch_twins(arch, dtype)
    calls = count_layer_calls(monkeypatch)
    ids = ours.encode_prompt("w20 w31 w9 w9 w40 w12 w3")
    caches = ours.new_cache(), theirs.new_cache()
    ours.forward(torch.tensor([ids]), caches[0])
    theirs.forward(torch.tensor([ids]), caches[1])
    steps = [5, 9, 33, 2, 17, 40, 8, 11]
    for token in steps:
        got = ours.forward(torch.tensor([[token]]), caches[0]).logits
        expected = theirs.forward(torch.tensor([[token]]), caches[1]).logits
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= TOLERANCE[dtype] * scale, f"after token {token}"
    end = len(caches[0])
    for name in ("keys", "values"):
        a, b = getattr(caches[0], name)[:, :, :, :end].float(), getattr(caches[1], name)[:, :, :, :end].float()
        assert (a - b).abs().max().item() <= TOLERANCE[dtype] * max(b.abs().max().item(), 1.0)
    passes = len(steps) + (len(ids) <= 16)  # a prompt of up to 16 tokens runs through the C layers too
    assert calls[0] == passes * ours.num_layers


@needs_native
def test_one_token_layers_roll_back_like_the_cache(monkeypatch):
    """A step after a rollback overwrites the stale position: the same token at the same position gives the same
    logits as the first time."""
    target = tiny_target("llama", logit_scale=4.0)
    calls = count_layer_calls(monkeypatch)
    ids = target.encode_prompt("w20 w31 w9")
    cache = target.new_cache()
    target.forward(torch.tensor([ids]), cache)
    first = target.forward(torch.tensor([[7]]), cache).logits
    target.forward(torch.tensor([[8]]), cache)
    cache.truncate(len(ids))
    target.forward(torch.tensor([[9]]), cache)  # writes position len(ids) with another token
    cache.truncate(len(ids))
    torch.testing.assert_close(target.forward(torch.tensor([[7]]), cache).logits, first, rtol=0, atol=0)
    assert calls[0] == 5 * target.num_layers  # the prompt and four steps


@needs_native
def test_the_one_call_stack_follows_weights_written_in_place_and_new_plans(monkeypatch):
    """The C stack's arguments are checked once per pass, not rebuilt: a weight written in place (its version moves)
    must reach the next pass, and a plan without our kernel must stop the C layers."""
    from dflash.models.kernels import PLAIN

    ours, theirs = native_and_torch_twins("llama", torch.float32)
    calls = count_layer_calls(monkeypatch)
    caches = ours.new_cache(), theirs.new_cache()
    for target, cache in zip((ours, theirs), caches):
        target.forward(torch.tensor([[5, 6, 7, 8]]), cache)
        target.forward(torch.tensor([[9]]), cache)
    with torch.no_grad():
        for target in (ours, theirs):
            target.engine.layers[1].mlp.gate_up.weight.mul_(3.0)  # the fused product's own weight
    got = ours.forward(torch.tensor([[10]]), caches[0]).logits
    expected = theirs.forward(torch.tensor([[10]]), caches[1]).logits
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert calls[0] == 3 * ours.num_layers
    for layer in ours.engine.layers:
        for lin in (layer.self_attn.qkv, layer.mlp.down_fast):
            lin.use_plan(PLAIN)
    ours.forward(torch.tensor([[11]]), caches[0])
    assert calls[0] == 3 * ours.num_layers  # torch's layers now


@needs_native
def test_the_stack_check_compares_products_only_when_one_may_have_changed():
    """The C stack's per-pass check (transformer.ProductsUnchanged) reads every weight's version each pass, and the
    products' identities and plans only after kernels.products_generation moved: products swapped between layers
    (no new object made), a plan, a weight buffer replaced or a cast are each seen; a plan given to a product
    elsewhere moves the count without failing the check."""
    from dflash.models.kernels import PLAIN, products_generation
    from dflash.models.transformer import ProductsUnchanged

    ours, _ = native_and_torch_twins("llama", torch.float32)
    cache = ours.new_cache()
    ours.forward(torch.tensor([[5, 6, 7, 8]]), cache)
    ours.forward(torch.tensor([[9]]), cache)
    check = ours.engine.__dict__["_stack_args"][1]
    assert check.holds()
    elsewhere = FrozenLinear(torch.randn(8, 8))  # a product outside the target
    elsewhere.use_plan(PLAIN)
    assert check.holds() and check.generation == products_generation()
    first, second = ours.engine.layers[0].mlp, ours.engine.layers[1].mlp
    first.down_fast, second.down_fast = second.down_fast, first.down_fast
    assert not check.holds()
    first.down_fast, second.down_fast = second.down_fast, first.down_fast
    assert check.holds()
    with torch.no_grad():
        ours.engine.layers[1].self_attn.o_fast.weight.add_(1.0)  # in place: its version moves
    assert not check.holds()
    fresh = ProductsUnchanged(ours.engine.layers)
    ours.engine.layers[0].self_attn.o_fast.weight = ours.engine.layers[0].self_attn.o_fast.weight.clone()
    assert not fresh.holds()
    fresh = ProductsUnchanged(ours.engine.layers)
    ours.engine.layers[0].mlp.gate_up.use_plan(PLAIN)
    assert not fresh.holds()
    fresh = ProductsUnchanged(ours.engine.layers)
    ours.engine.layers[0].mlp.down_fast.to(torch.float64)
    assert not fresh.holds()


@needs_native
def test_rows_of_more_than_sixteen_tokens_take_the_torch_layers_batches_do_not(monkeypatch):
    """A first row of 17 new tokens is a prompt: torch's layers where prompts are kept out of C. Any number of rows of up to 16 (a batch of steps
    or of verify passes, here 2 x 9 = 18 tokens) runs in C, so that each row's tokens go through the chains they
    would alone (test_batching: batched rounds equal solo runs), and so do rows of up to 64 after a cached prefix
    (verify passes of blocks over 16); 65 go to torch. (Prompts kept out of C, as a machine where torch's layers
    read them faster measures: test_prompts_run_through_the_c_stack_in_passes_of_64 has the other choice.)"""
    target = tiny_target("llama", logit_scale=4.0)
    target.engine.prompts_in_c_up_to = 0
    calls = count_layer_calls(monkeypatch)
    single = target.new_cache(capacity=160)
    target.forward(torch.tensor([list(range(5, 22))]), single)  # 17 tokens: a prefill
    assert calls[0] == 0
    cache = target.new_cache(batch=2)
    target.forward(torch.tensor([list(range(5, 14)), list(range(20, 29))]), cache)  # 2 x 9 = 18 tokens
    target.forward(torch.tensor([[5], [6]]), cache)  # a batched step
    target.forward(torch.tensor([[5, 6, 7]]), single)
    assert calls[0] == 3 * target.num_layers
    target.forward(torch.tensor([[(7 * i) % 50 + 5 for i in range(32)]]), single)  # a verify pass of 32
    assert calls[0] == 4 * target.num_layers
    target.forward(torch.tensor([[(3 * i) % 50 + 5 for i in range(65)]]), single)
    assert calls[0] == 4 * target.num_layers


@needs_native
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prompts_run_through_the_c_stack_in_passes_of_64(arch, dtype, monkeypatch):
    """A one-row prompt goes through the C stack, 64 tokens a pass (unmeasured targets; or 128 or 256, as
    measured), up to the measured length (unmeasured targets: any). Each token takes the chains of a step, so a
    prompt split anywhere else, or in passes of another length, writes bitwise the same cache and gives the same
    logits and features (a prefix cache's hit reads what the whole prompt would have written); every logits_at
    reads the same hidden states; torch's layers, whole, agree within rounding."""
    target = tiny_target(arch, logit_scale=4.0, hidden_size=128)
    target.model.to(dtype)
    choose_kernels(target, "native")
    engine = target.engine
    calls = count_layer_calls(monkeypatch)
    prompt = torch.tensor([[(7 * i) % 50 + 5 for i in range(150)]])
    whole = target.new_cache(capacity=160)
    logits, features = engine(prompt, whole, (0, 2))
    assert calls[0] == 3 * target.num_layers  # 64 + 64 + 22 tokens
    split = target.new_cache(capacity=160)
    first, rest = engine(prompt[:, :37], split, (0, 2)), engine(prompt[:, 37:], split, (0, 2))
    assert torch.equal(torch.cat([first[0], rest[0]], 1), logits)
    assert torch.equal(torch.cat([first[1], rest[1]], 1), features)
    assert torch.equal(split.keys[..., :150, :], whole.keys[..., :150, :])
    assert torch.equal(split.values[..., :150, :], whole.values[..., :150, :])
    for chunk, passes in ((128, 2), (256, 1)):  # 128 + 22; 150 at once
        engine.prompt_chunk, calls[0] = chunk, 0
        longer = target.new_cache(capacity=160)
        assert torch.equal(engine(prompt, longer, (0, 2))[0], logits) and calls[0] == passes * target.num_layers
        assert torch.equal(longer.keys[..., :150, :], whole.keys[..., :150, :])
    engine.prompt_chunk = 64
    for logits_at, expected in (("last", logits[:, -1:]), (torch.tensor([99]), logits[:, 99:100]), ("none", None)):
        got, got_features = engine(prompt, target.new_cache(capacity=160), (0, 2), logits_at)
        assert (got is None and expected is None) or torch.equal(got, expected)
        assert torch.equal(got_features, features)
    hidden, _ = engine(prompt, target.new_cache(capacity=160), (), "hidden")
    assert torch.equal(engine.logits(hidden, "all"), logits)
    engine.prompts_in_c_up_to = 149  # measured up to 149 tokens: this prompt goes to torch's layers, whole
    calls[0] = 0
    in_torch, torch_features = engine(prompt, target.new_cache(capacity=160), (0, 2))
    assert calls[0] == 0
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(in_torch, logits, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(torch_features.float(), features.float(), rtol=tolerance, atol=tolerance)


@needs_native
@pytest.mark.parametrize("width", [17, 32, 64])
def test_verify_passes_over_sixteen_tokens_give_bitwise_the_logits_of_steps(width, dtype):
    """Blocks of more than 16 (--block-size 32) are verified in C as well, bitwise as their steps: through torch's
    layers a bfloat16 SmolLM2 gave other greedy tokens than `ar` with ngram@32:whole in 3 of 3 GSM8K answers."""
    target = tiny_target("qwen3", logit_scale=4.0, hidden_size=128)
    target.model.to(dtype)
    choose_kernels(target, "native")
    wide, steps = wide_pass_and_steps(target, width)
    assert torch.equal(wide, steps)


@needs_native
@pytest.mark.parametrize("width", [8, 16])
def test_float32_verify_passes_give_bitwise_the_logits_of_steps_with_each_kernel(width, f32_kernel):
    target = tiny_target("llama", logit_scale=4.0, hidden_size=128)
    choose_kernels(target, "native")
    native.set_f32_kernel(f32_kernel)  # (the plan keeps the machine's choice; the test forces each)
    wide, steps = wide_pass_and_steps(target, width)
    assert torch.equal(wide, steps)


@needs_native
@pytest.mark.parametrize("width", [2, 3, 4, 5, 8])
def test_narrow_verify_passes_give_bitwise_the_logits_of_steps_either_way(width, dtype, narrow_way):
    """Passes of a few tokens read the panels two at a time or one at a time with the next chunk requested
    (native.narrow_passes, chosen per machine): either way each output is its one chain, so a verify pass is
    bitwise its steps."""
    target = tiny_target("llama", logit_scale=4.0, hidden_size=128)
    target.model.to(dtype)
    choose_kernels(target, "native")
    native.set_narrow_passes(narrow_way)  # (choose_kernels leaves a forced plan's narrow passes as they were)
    wide, steps = wide_pass_and_steps(target, width)
    assert torch.equal(wide, steps)


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_ragged_batches_in_c_match_the_torch_forward(arch, dtype, monkeypatch):
    """Rows at different lengths (as after each accepted a different number of drafts): each row's tokens go to
    their own positions and attend to their own row only, in C as in torch."""
    ours, theirs = native_and_torch_twins(arch, dtype)
    prompts = torch.tensor([[(5 * r + i) % 50 + 5 for i in range(9)] for r in range(3)])
    caches = ours.new_cache(batch=3), theirs.new_cache(batch=3)
    for target, cache in zip((ours, theirs), caches):
        target.forward(prompts, cache)  # 27 tokens: torch in both
        cache.set_lengths([9, 6, 7])
    calls = count_layer_calls(monkeypatch)
    for block in ([[11, 12], [13, 14], [15, 16]], [[17], [18], [19]], [[20, 21, 22, 23, 24]] * 3):
        got = ours.forward(torch.tensor(block), caches[0], (1,))
        expected = theirs.forward(torch.tensor(block), caches[1], (1,))
        for a, b in ((got.logits, expected.logits), (got.features, expected.features)):
            assert (a.float() - b.float()).abs().max().item() <= TOLERANCE[dtype] * b.float().abs().max().item()
        assert caches[0].lengths == caches[1].lengths
    assert calls[0] == 3 * ours.num_layers
    for r, end in enumerate(caches[1].lengths):
        a, b = caches[0].values[:, r, :, :end].float(), caches[1].values[:, r, :, :end].float()
        assert (a - b).abs().max().item() <= TOLERANCE[dtype] * max(b.abs().max().item(), 1.0)


@needs_native
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: attention sums values in registers, heads of 64 floats at a time
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "gemma3"])
def test_verify_passes_in_c_match_the_torch_forward(arch, dtype, head_dim, monkeypatch):
    """Passes of 2-16 tokens (causal among themselves, after a cached prefix) with features (written by the C
    stack straight into their side-by-side layout): logits, features and cache as the torch forward's. The cache grows past 8, 16 and 32 positions: keys are scored eight at a time and
    the rest one by one; past 16 tiny Gemma3's local layers see only their window."""
    ours, theirs = native_and_torch_twins(arch, dtype, head_dim)
    calls = count_layer_calls(monkeypatch)
    ids = ours.encode_prompt("w20 w31 w9 w9 w40 w12 w3")
    caches = ours.new_cache(), theirs.new_cache()
    for width in (2, 5, 16, 3):
        block = torch.tensor([[(7 * width + i) % 50 + 5 for i in range(width)]])
        if width == 2:
            block = torch.tensor([ids])[:, :width]
        got = ours.forward(block, caches[0], (2, 0, 2))  # in any order, one named twice: each in its slice
        expected = theirs.forward(block, caches[1], (2, 0, 2))
        for a, b in ((got.logits, expected.logits), (got.features, expected.features)):
            assert (a.float() - b.float()).abs().max().item() <= TOLERANCE[dtype] * b.float().abs().max().item()
    assert calls[0] == 4 * ours.num_layers
    end = len(caches[0])
    a, b = caches[0].keys[:, :, :, :end].float(), caches[1].keys[:, :, :, :end].float()
    assert (a - b).abs().max().item() <= TOLERANCE[dtype] * max(b.abs().max().item(), 1.0)


@needs_native
def test_a_plan_without_native_for_one_row_keeps_the_torch_layers(monkeypatch):
    target = tiny_target("qwen3", logit_scale=4.0)
    choose_kernels(target, "packed")
    calls = count_layer_calls(monkeypatch)
    cache = target.new_cache()
    target.forward(torch.tensor([[5, 6, 7]]), cache)
    target.forward(torch.tensor([[5]]), cache)
    assert calls[0] == 0


@needs_native
@pytest.mark.parametrize("layer_in_c_wins", [True, False])
def test_layer_passes_are_timed_whole(monkeypatch, layer_in_c_wins):
    """A plan whose per-product timings chose oneDNN for one shape would lose the one-call layer; 1-token and
    8-token passes are timed both ways (clock injected: a layer costs 1 or 10 units in C or in torch) and the
    faster plan kept for each."""
    from dflash.models.kernels import KernelPlan
    from dflash.models.target import settle_layer_kernels
    from dflash.models.transformer import DecoderLayer

    clock = [0.0]
    in_c, in_torch = (1, 10) if layer_in_c_wins else (10, 1)
    real_step, real_stack = DecoderLayer.native_step, native.stack

    def timed_step(self, *args):
        out = real_step(self, *args)
        clock[0] += in_c if out is not None else in_torch
        return out

    def timed_stack(h, layers, *args):
        out = real_stack(h, layers, *args)
        clock[0] += in_c * len(layers)
        return out

    monkeypatch.setattr(DecoderLayer, "native_step", timed_step)
    monkeypatch.setattr(native, "stack", timed_stack)
    target = tiny_target("llama", logit_scale=4.0)
    hidden, inter = target.hidden_size, target.config.intermediate_size
    plan = KernelPlan({shape_key(2 * inter, hidden, torch.float32, bucket): "packed" for bucket in (1, 16)},
                      default="native")
    chosen = settle_layer_kernels(target, plan, timer=lambda: clock[0])
    for rows, bucket in ((1, 1), (8, 16)):
        assert chosen.kernel(2 * inter, hidden, torch.float32, rows) == ("native" if layer_in_c_wins else "packed")
        assert set(chosen.timings_ms[f"{rows}-token pass"]) == {"measured", "fused"}
        assert target.engine.layers[0].mlp.gate_up.kernel_for_rows(rows) == chosen.kernel(
            2 * inter, hidden, torch.float32, rows)


@needs_native
@pytest.mark.parametrize("context", [18, 29, 61], ids=lambda n: f"context{n}")
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_verify_pass_gives_bitwise_the_logits_of_steps(arch, dtype, head_dim, context, monkeypatch):
    """Why speculation through the C layers stays lossless even in bf16, where near-ties are common: every product
    sums each row in the same order whatever the number of rows, and each token's attention reads the same cache,
    so verifying k tokens at once gives exactly the logits of stepping them one by one. Contexts put the verified
    tokens inside the attention's first block of 32 cache positions, across its end (29..35) and in the second;
    Gemma3's local layers then see a window of 16 that slides within the pass."""
    target = tiny_target(arch, logit_scale=4.0, hidden_size=4 * head_dim)
    target.model.to(dtype)
    choose_kernels(target, "native")
    calls = count_layer_calls(monkeypatch)
    words = "w20 w31 w9 w9 w40 w12 w3 w8 w30 w11 w5 w7 w21 w22 w23 w1 w2 w3".split()
    ids = (target.encode_prompt(" ".join(words)) * 4)[:context]
    block = [9, 33, 2, 17, 40, 8, 11]
    together, alone = target.new_cache(), target.new_cache()
    target.forward(torch.tensor([ids]), together)
    target.forward(torch.tensor([ids]), alone)
    calls[0] = 0  # the prompts' passes (in C as well, unmeasured) are not what is counted
    wide = target.forward(torch.tensor([block]), together, (1, 2)).logits[0]
    steps = torch.cat([target.forward(torch.tensor([[token]]), alone, (1, 2)).logits[0] for token in block])
    assert torch.equal(wide, steps)
    assert calls[0] == (1 + len(block)) * target.num_layers


def check_attention_pairs(target, ids, block, switch=None) -> None:
    """A verify pass of `block` after `ids` with attention in pairs (scores and value sums through VDPBF16PS) and
    without (or with `switch`, e.g. `native.set_attention_tiles`, on and off): each gives bitwise the logits of
    stepping the block's tokens one by one, and the two agree within bfloat16 rounding. The caches' never-written
    value slots read as NaN: a step's last pair of keys may reach one, and must not read it."""
    switch = switch or native.set_attention_pairs
    logits = {}
    try:
        for pairs in (True, False):
            switch(pairs)
            together, alone = target.new_cache(), target.new_cache()
            for cache in (together, alone):
                cache.values.fill_(float("nan"))
            target.forward(torch.tensor([ids]), together)
            target.forward(torch.tensor([ids]), alone)
            wide = target.forward(torch.tensor([block]), together).logits[0]
            steps = torch.cat([target.forward(torch.tensor([[t]]), alone).logits[0] for t in block])
            assert torch.equal(wide, steps)
            logits[pairs] = wide.float()
    finally:
        switch(True)
    assert (logits[True] - logits[False]).abs().max() <= TOLERANCE[torch.bfloat16] * logits[False].abs().max()


@pytest.mark.skipif(not pairs_run_here(), reason="no AVX512-BF16 here")
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: sixteen keys at a time in registers; 16: a masked half vector
def test_attention_scored_in_pairs_keeps_verify_equal_to_steps_and_close_to_fmas(head_dim, monkeypatch):
    """A bfloat16 model in pairs scores attention with VDPBF16PS (block_scores_pairs): verifying still gives bitwise
    the logits of steps (keys scored sixteen at a time, or fewer at a block's end, by one tree per key), and the
    logits stay within bfloat16 rounding of scoring with FMAs over widened keys."""
    target = tiny_target("llama", logit_scale=4.0, hidden_size=4 * head_dim)
    target.model.to(torch.bfloat16)
    old = native.set_bf16_pairs(True)
    try:
        choose_kernels(target, "native")
        ids = (target.encode_prompt("w20 w31 w9 w9 w40 w12 w3 w8 w30 w11 w5 w7 w21") * 4)[:45]
        check_attention_pairs(target, ids, [9, 33, 2, 17, 40, 8, 11])
    finally:
        native.set_bf16_pairs(old)


def values_in_registers_here() -> bool:
    old = native.set_values_in_registers(True)
    return native.set_values_in_registers(old)  # the setting just made: on only where the CPU has AVX-512F


def attention_shape_target(arch: str, shape: tuple[int, int, int], dtype: torch.dtype):
    """A 2-layer tiny Llama or Gemma3 (a window of 8 on its first layer) of `shape` (query heads, kv heads, head
    size) in `dtype`, on our kernels (laid out as the bfloat16 layout in force says)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    from dflash.models.target import TargetModel
    from dflash.testing import tiny_tokenizer

    heads, kv_heads, head_dim = shape
    extra = {"sliding_window": 8, "query_pre_attn_scalar": head_dim,
             "layer_types": ["sliding_attention", "full_attention"]} if arch == "gemma3" else {}
    config = (Gemma3TextConfig if arch == "gemma3" else LlamaConfig)(
        vocab_size=64, hidden_size=heads * head_dim // 2, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=256,
        eos_token_id=1, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False, **extra)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(dtype)
    target = TargetModel(model=model, tokenizer=tiny_tokenizer(64), name=f"{arch}-{heads}-{kv_heads}-{head_dim}",
                         measure=False)
    choose_kernels(target, "native")
    return target


def assert_the_same_either_way(target, switch) -> None:
    """With attention in pairs off (in pairs, scores and values go through VDPBF16PS either way), `switch` on and
    off give bitwise the same logits for a prompt and the passes after it (attention_passes)."""
    ids = (target.encode_prompt("w20 w31 w9 w9 w40 w12 w3 w8 w30 w11 w5 w7 w21") * 3)[:37]
    logits = {}
    old, pairs = switch(True), native.set_attention_pairs(False)
    try:
        for on in (True, False):
            switch(on)
            logits[on] = attention_passes(target, ids)
    finally:
        switch(old)
        native.set_attention_pairs(pairs)
    for got, expected in zip(logits[True], logits[False]):
        assert torch.equal(got, expected)


def attention_passes(target, ids: list[int]) -> list[torch.Tensor]:
    """The logits of a prompt of 37 tokens, a step after it, a verify pass of 7, another step, and a verify pass of
    3 tokens in a batch of three rows cut back to ragged lengths."""
    cache, batch = target.new_cache(), target.new_cache(3)
    outputs = [target.forward(torch.tensor([ids]), cache).logits]
    target.forward(torch.tensor([ids] * 3), batch)
    batch.set_lengths([37, 30, 34])
    outputs += [target.forward(torch.tensor([block]), cache).logits for block in ([9], [33, 2, 17, 40, 8, 11, 4], [5])]
    outputs.append(target.forward(torch.tensor([[9, 33, 2], [17, 40, 8], [11, 4, 5]]), batch).logits)
    return outputs


@pytest.mark.skipif(native.library() is None or not values_in_registers_here(), reason="no AVX-512F here")
@pytest.mark.parametrize("shape", [(6, 2, 64), (4, 2, 64), (3, 1, 24)], ids=["group3", "group2", "head24"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_scores_two_queries_at_a_time_give_bitwise_the_query_by_query_scores(arch, shape, dtype):
    """Float32 attention scores two queries at once in AVX-512 registers (block_scores_two): a token's heads in
    pairs, or its last head with the next token's first, whose keys end one apart (a causal pass) or start apart
    (Gemma3's window). Each score is the very chain of FMAs and sum of lanes of the query-by-query loop: the same
    logits, bit for bit, for a prompt, steps, verify passes and a batch of ragged rows, with a group of 3 (pairs
    across tokens) and heads of 24 (eights, then keys one by one)."""
    assert_the_same_either_way(attention_shape_target(arch, shape, dtype), native.set_scores_two)


@pytest.mark.skipif(native.library() is None or not values_in_registers_here(), reason="no AVX-512F here")
@pytest.mark.parametrize("shape", [(4, 2, 64), (8, 1, 64), (2, 1, 128)], ids=["group2", "group8", "head128"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_values_summed_in_registers_give_bitwise_the_head_by_head_sums(arch, shape, dtype):
    """Attention's value sums for several query heads at once in AVX-512 registers (values64) are the very chains
    of FMAs the head-by-head loop sums: the same logits, bit for bit, for steps, verify passes (a token's keys end
    one apart), a batch of ragged rows, and Gemma3's sliding window (heads whose keys start apart), with more query
    heads than one call takes (group 8: 16 heads a work item) and heads of 128 (two calls of 64 columns)."""
    assert_the_same_either_way(attention_shape_target(arch, shape, dtype), native.set_values_in_registers)


@pytest.mark.skipif(not pairs_run_here(), reason="no AVX512-BF16 here")
@pytest.mark.parametrize("context", [36, 37], ids=["even", "odd"])  # the verified tokens' key pairs start whole / split
@pytest.mark.parametrize("shape", [(4, 2, 64), (8, 1, 64), (2, 1, 128)], ids=["group2", "group8", "head128"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_values_summed_in_pairs_keep_verify_equal_to_steps_and_close_to_fmas(arch, shape, context):
    """A bfloat16 model in pairs sums attention's values with VDPBF16PS over pairs of keys (value_pairs64), its
    weights rounded to bfloat16: a verify pass still gives bitwise the logits of steps, whose last key pair is half
    outside the step (a stale or unwritten slot read as zero), also with Gemma3's window (heads whose first pairs
    are split), group 8 (16 queries an item) and heads of 128; the logits stay within bfloat16 rounding of summing
    the float32 weights with FMAs."""
    old = native.set_bf16_pairs(True)
    try:
        target = attention_shape_target(arch, shape, torch.bfloat16)
        ids = (target.encode_prompt("w20 w31 w9 w9 w40 w12 w3 w8 w30 w11 w5 w7 w21") * 3)[:context]
        check_attention_pairs(target, ids, [33, 2, 17, 40, 8, 11, 4])
    finally:
        native.set_bf16_pairs(old)


@pytest.mark.skipif(not amx_runs_here(), reason="no AMX here")
@pytest.mark.parametrize("context", [36, 37, 48], ids=["even", "odd", "whole-tiles"])
@pytest.mark.parametrize("shape", [(4, 2, 64), (16, 1, 64), (2, 1, 128)], ids=["group2", "group16", "head128"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_attention_through_tiles_keeps_verify_equal_to_steps_and_close_to_pairs(arch, shape, context):
    """A bfloat16 model whose products run through AMX tiles scores its keys and sums its values through tiles too
    (tile_scores, tile_values): a verify pass still gives bitwise the logits of steps, with never-written value slots
    at NaN, keys that end inside a tile of 16 or on its edge, Gemma3's window, more queries than one tile holds
    (group 16: 32 queries an item) and heads of 128, also in a batch of ragged rows; and the logits stay within
    bfloat16 rounding of attention in VDPBF16PS chains."""
    old = native.set_bf16_pairs(True), native.set_amx(True)
    try:
        target = attention_shape_target(arch, shape, torch.bfloat16)
        ids = (target.encode_prompt("w20 w31 w9 w9 w40 w12 w3 w8 w30 w11 w5 w7 w21") * 4)[:context]
        check_attention_pairs(target, ids, [33, 2, 17, 40, 8, 11, 4], native.set_attention_tiles)
        block = torch.tensor([[9, 33, 2], [17, 40, 8], [11, 4, 5]])
        together, alone = target.new_cache(3), target.new_cache(3)
        for cache in (together, alone):
            target.forward(torch.tensor([ids] * 3), cache)
            cache.set_lengths([context, context - 7, context - 3])
        wide = target.forward(block, together).logits
        steps = torch.cat([target.forward(block[:, i:i + 1], alone).logits for i in range(3)], dim=1)
        assert torch.equal(wide, steps)
    finally:
        native.set_bf16_pairs(old[0])
        native.set_amx(old[1])


@pytest.mark.skipif(not amx_runs_here(), reason="no AMX here")
@pytest.mark.parametrize("context", [70, 100], ids=["whole-blocks", "split-blocks"])
def test_attention_through_tiles_shifts_each_softmax_by_the_largest_score_it_stored(context):
    """Through tiles each query's largest score is taken as its scores are stored, in blocks of 32 keys (unmasked
    where every query of an item reads the whole block, masked at its edges), and softmax's division by the sum
    waits for the weights' rounding to pairs. With queries 3000x sharper, scores run to the hundreds, and a shift
    below the largest would overflow the exponentials: a 24-token pass (items of 8 queries, scores transposed in
    registers) still gives bitwise its steps, finite and within bfloat16 rounding of attention in VDPBF16PS."""
    old = native.set_bf16_pairs(True), native.set_amx(True)
    try:
        target = attention_shape_target("llama", (4, 2, 64), torch.bfloat16)
        with torch.no_grad():
            for layer in target.model.model.layers:
                layer.self_attn.q_proj.weight.mul_(3000.0)
        choose_kernels(target, "native")
        ids = (target.encode_prompt("w20 w31 w9 w9 w40 w12 w3 w8 w30 w11 w5 w7 w21") * 9)[:context]
        block = [33, 2, 17, 40, 8, 11, 4, 9, 21, 30, 5, 7, 12, 44, 3, 18, 27, 36, 6, 14, 25, 39, 10, 2]
        check_attention_pairs(target, ids, block, native.set_attention_tiles)
        assert torch.isfinite(target.forward(torch.tensor([ids + block])).logits).all()
    finally:
        native.set_bf16_pairs(old[0])
        native.set_amx(old[1])


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "gemma3"])
def test_odd_shapes_decode_like_transformers(arch):
    """Sizes the tiles must pad (hidden 45, head size 10, MLP 90, vocabulary 70, one KV head for five query heads):
    greedy decoding through the C layers, plain and speculative, equals transformers' generate (Gemma3: a window
    of 8 in its local layers, which the 47 positions pass)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    from conftest import OracleProposer, RandomProposer
    from dflash.engine import GenerationConfig, SpeculativeDecoder
    from dflash.models.target import TargetModel
    from dflash.testing import tiny_tokenizer

    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "gemma3": Gemma3TextConfig}[arch]
    extra = {"sliding_window": 8, "query_pre_attn_scalar": 10,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]} if arch == "gemma3" else {}
    config = config_class(vocab_size=70, hidden_size=45, intermediate_size=90, num_hidden_layers=3,
                          num_attention_heads=5, num_key_value_heads=1, head_dim=10, max_position_embeddings=256,
                          eos_token_id=1, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False, **extra)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)  # sharp: distinct argmaxes
    target = TargetModel(model=model, tokenizer=tiny_tokenizer(70), name=f"odd-{arch}", measure=False)
    choose_kernels(target, "native")
    ids = target.encode_prompt("w20 w31 w9 w9 w40 w12 w3")
    new = 40
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
    config = GenerationConfig(max_new_tokens=new, ignore_eos=True)
    for proposer in (None, RandomProposer(70, 7), OracleProposer(expected, len(ids), 7)):
        assert SpeculativeDecoder(target, proposer).generate(ids, config).tokens == expected
    assert target.engine.layers[0]._native_constants(torch.float32, 1) is not None  # the C layers ran


@needs_native
def test_a_wrong_input_width_is_torch_s_error_not_a_wild_read():
    lin = FrozenLinear(torch.randn(8, 16), None, NATIVE)
    with pytest.raises(RuntimeError):
        lin(torch.randn(1, 24))


# ---- the DFlash drafter's layers in one C call ------------------------------------------------------------------
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from dflash.models.kernels import PLAIN  # noqa: E402


def drafter_twins(target, dtype: torch.dtype, block_size: int):
    """One random drafter twice, frozen with our kernels (its layers then run in C) and with torch's."""
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, 2, num_layers=2, block_size=block_size,
                                  num_features=3)
    ours = DFlashDrafter.untrained(cfg, seed=3).to(dtype)
    theirs = DFlashDrafter.untrained(cfg, seed=3).to(dtype)
    return ours.freeze(NATIVE), theirs.freeze(PLAIN)


def count_drafter_stacks(monkeypatch) -> list[int]:
    calls = [0]
    real = native.drafter_stack

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(native, "drafter_stack", counted)
    return calls


@needs_native
@pytest.mark.parametrize("block_size", [4, 16])
def test_drafter_layers_in_c_match_the_torch_layers(dtype, block_size, monkeypatch):
    """Rounds of context pieces of 11, 1, 3 and 7 rows, then a block: the C drafter (context keys through each
    layer's kv product, q/k norms, the block attending both ways) gives the torch drafter's hidden states and
    cache, and one C call per round runs all its layers."""
    target = tiny_target("llama", hidden_size=64)
    ours, theirs = drafter_twins(target, dtype, block_size)
    calls = count_drafter_stacks(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    caches = ours.new_cache(), theirs.new_cache()
    done = 0
    for rounds, pieces in enumerate((11, 1, 3, 7), start=1):
        features = (3 * torch.randn(1, pieces, 3 * 64, generator=generator)).to(dtype)
        block = torch.randint(5, 60, (1, block_size), generator=generator)
        block[0, 1:] = 2
        embeds = target.embed_tokens(block).to(dtype)
        start = done + pieces
        positions, context_positions = torch.arange(start, start + block_size)[None], torch.arange(done, start)[None]
        with torch.inference_mode():
            got = ours(embeds, positions, features, context_positions, cache=caches[0])
            expected = theirs(embeds, positions, features, context_positions, cache=caches[1])
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= TOLERANCE[dtype] * scale, f"round {rounds}"
        assert caches[0].lengths == caches[1].lengths == [start]
        for name in ("keys", "values"):  # the context's entries (the block's lie past the length, never read)
            a, b = getattr(caches[0], name)[..., :start, :].float(), getattr(caches[1], name)[..., :start, :].float()
            assert (a - b).abs().max().item() <= TOLERANCE[dtype] * max(b.abs().max().item(), 1.0)
        assert calls[0] == rounds
        done = start


@needs_native
def test_a_drafter_block_attends_both_ways_in_c():
    """Changing the block's last token changes the first token's output, as in training (a causal C attention
    would leave it alone)."""
    target = tiny_target("llama", hidden_size=64)
    ours, _ = drafter_twins(target, torch.float32, 8)
    features = torch.randn(1, 5, 3 * 64, generator=torch.Generator().manual_seed(1))
    outputs = []
    for last in (2, 9):
        block = torch.tensor([[7, 2, 2, 2, 2, 2, 2, last]])
        with torch.inference_mode():
            outputs.append(ours(target.embed_tokens(block), torch.arange(5, 13)[None], features,
                                torch.arange(0, 5)[None], cache=ours.new_cache()))
    assert not torch.allclose(outputs[0][0, 0], outputs[1][0, 0])


@needs_native
def test_a_plain_plan_keeps_the_torch_drafter_layers(monkeypatch):
    """C runs a drafter's layers only where the plan chose our kernel for them."""
    target = tiny_target("llama", hidden_size=64)
    _, theirs = drafter_twins(target, torch.float32, 8)
    monkeypatch.setattr(native, "drafter_stack", lambda *a: pytest.fail("a plain plan ran the C drafter"))
    with torch.inference_mode():
        theirs(target.embed_tokens(torch.tensor([[7] + [2] * 7])), torch.arange(4, 12)[None],
               torch.randn(1, 4, 3 * 64), torch.arange(0, 4)[None], cache=theirs.new_cache())


@needs_native
def test_a_targets_plan_lays_out_its_weights_before_the_first_pass():
    """Our kernel for steps and verify passes, oneDNN's packed weights for prompts (what bfloat16 chose on Zen 4):
    both copies are made when the plan is set, not in the first prompt or step that reads them (a first bfloat16
    step took 187 ms instead of 7), and a pass then reads those copies."""
    from dflash.models.kernels import ROW_BUCKETS, KernelPlan, row_bucket
    from dflash.testing import tiny_target

    target = tiny_target("llama")
    linears = target.engine.frozen_linears()
    choices = {shape_key(lin.out_features, lin.in_features, lin.weight.dtype, row_bucket(rows)): kernel
               for lin in linears for rows, kernel in zip(ROW_BUCKETS, ("native", "native", "packed"))}
    target.use_kernels(KernelPlan(choices, default="plain"))
    made = [(lin._tiles, lin._packed) for lin in linears]
    assert all(tiles is not None and packed is not None for tiles, packed in made)
    cache = target.new_cache(capacity=64)
    target.forward(torch.tensor([list(range(3, 40))]), cache)  # a prompt (packed), then a step (ours)
    target.forward(torch.tensor([[5]]), cache)
    assert all(lin._tiles is tiles and lin._packed is packed for lin, (tiles, packed) in zip(linears, made))


@needs_native
@pytest.mark.parametrize("fastest", ["measured", "fused", "fused+head", "fused+int8-head"])
def test_a_drafter_in_another_dtype_takes_our_kernels_where_that_drafts_faster(tmp_path, monkeypatch, fastest):
    """A bfloat16 drafter on a float32 target has shapes the target's plan never measured. Whether its layers run
    as one C call (every product ours), and then whether its LM head runs on ours too (float, or int8 rows where
    the CPU has VNNI), is decided by timing whole drafting passes (the clock injected here), cached per machine.
    int8 plans are left alone."""
    from dflash.methods.dflash.proposer import DFlashProposer, load_drafter, settled_kernels
    from dflash.models.kernels import INT8, PACKED

    vnni = native.int8_vnni()
    if fastest == "fused+int8-head" and not vnni:
        pytest.skip("no AVX512-VNNI here")

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_target("llama", vocab_size=96, logit_scale=4.0)  # a head of no layer product's shape
    drafter, _ = load_drafter(None, target, torch.bfloat16, PACKED)
    proposer = DFlashProposer(drafter, target, None, PACKED)
    assert proposer.lm_head.weight.dtype == torch.bfloat16 and "native" in proposer.lm_head.kernels()

    def state() -> str:
        layers_in_c = all(lin.kernel_for_rows(16) == "native" for layer in drafter.layers
                          for lin in (layer.self_attn.qkv, layer.self_attn.o_fast, layer.mlp.gate_up,
                                      layer.mlp.down_fast))
        head = proposer.lm_head.kernel_for_rows(4)
        if layers_in_c and head in ("native", "vnni"):
            return "fused+head" if head == "native" else "fused+int8-head"
        return "fused" if layers_in_c else "measured"

    timed = []
    fake = lambda p, t: timed.append(state()) or (1.0 if state() == fastest else 2.0)  # noqa: E731
    chosen = settled_kernels(proposer, target, PACKED, "bfloat16", repeats=3, seconds=fake)
    candidates = ["measured", "fused", "fused+head"] + (["fused+int8-head"] if vnni else [])
    assert timed == candidates * 3  # every candidate, interleaved
    assert state() == fastest and proposer.plan is chosen and (chosen is PACKED) == (fastest == "measured")
    stacks = count_drafter_stacks(monkeypatch)
    ids = target.encode_prompt("w1 w2 w3 w4 w5")
    proposer.start(ids, torch.randn(1, len(ids), len(proposer.feature_layers) * target.hidden_size))
    proposer.propose(ids + [7])
    assert stacks[0] == (0 if fastest == "measured" else 1)
    settled_kernels(proposer, target, PACKED, "bfloat16", repeats=3, seconds=fake)
    assert len(timed) == 3 * len(candidates)  # the second engine reads the cache
    assert state() == fastest
    assert settled_kernels(proposer, target, INT8, "int8", seconds=fake) is INT8



@pytest.mark.parametrize("dim", [64, 37])  # eight lanes at a time, and a tail
@pytest.mark.parametrize("unit_offset", [False, True])  # Llama's norm, Gemma's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_final_norm_in_c_is_torchs_within_rounding(dim, unit_offset, dtype):
    """RMSNorm.rows (one C call, native.rms_norm) against RMSNorm.forward: the same values up to the order of the
    sum of squares (float32), or to one bfloat16 rounding; any leading shape, non-contiguous input made contiguous."""
    from dflash.models.layers import RMSNorm

    if native.library() is None:
        pytest.skip(f"no native kernels: {native.why_not}")
    norm = RMSNorm(dim, 1e-6, unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(-1.0, 2.0, generator=torch.Generator().manual_seed(0))
    x = (torch.randn(2, 5, dim * 2, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)[..., ::2]
    ours, theirs = norm.rows(x), norm(x)
    assert ours.shape == theirs.shape and ours.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert ((ours.float() - theirs.float()).abs() <= tolerance * theirs.float().abs().clamp_min(1.0)).all()


@needs_native
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_exponentials_sixteen_at_a_time_change_no_bit(arch, dtype):
    """Where the CPU has AVX-512F, softmax takes its exponentials sixteen at a time and adds each half to the eight
    lanes' sums in their order: every logit of steps and of verify passes after contexts whose key counts end at
    each remainder of 16 (and 8) is bitwise what eight at a time gives."""
    lib = native.library()
    target = tiny_target(arch, logit_scale=4.0)
    target.model.to(dtype)
    choose_kernels(target, "native")
    ids = target.encode_prompt("w20 w31 w9 w9 w40 w12 w3 w8 w30 w11 w5 w7 w21 w2 w6 w13 w14")
    block = [33, 2, 17, 40, 8, 11, 4]
    logits = {}
    for wide in (1, 0):
        old = lib.dflash_set_wide_exponentials(wide)
        try:
            cache, runs = target.new_cache(), []
            target.forward(torch.tensor([ids]), cache)
            for step in range(17):  # the contexts' key counts pass through every remainder of 16
                runs.append(target.forward(torch.tensor([block]), cache).logits)
                cache.truncate(len(ids) + step)
                target.forward(torch.tensor([[block[step % 7]]]), cache)
            logits[wide] = torch.cat(runs, 1)
        finally:
            lib.dflash_set_wide_exponentials(old)
    assert torch.equal(logits[1], logits[0])


@pytest.mark.parametrize("inter", [1, 7, 8, 9, 16, 24, 37, 44, 90, 1536])  # tails under 16 and 8 lanes
@pytest.mark.parametrize("gelu", [0, 1])
def test_the_gate_in_sixteen_lanes_is_bitwise_the_gate_in_eight_and_torchs_within_rounding(inter, gelu):
    """A bfloat16 model in pairs computes SiLU(gate) * up (GELU for Gemma) straight into down's bfloat16 input,
    sixteen lanes at a time: the same bits as the eight-lane gate and its conversion, padding to a multiple of 8
    zero; and torch's bfloat16 SiLU / tanh-GELU, each op rounded, within a rounding or two (gemma3's real MLP
    width 2048 and SmolLM2's 1536 have no tail: only the odd widths reach it)."""
    import ctypes

    lib = native.library()
    if lib is None or not lib.dflash_bf16_pairs():
        pytest.skip("this CPU has no bfloat16 pairs")
    m, ip = 3, (inter + 7) // 8 * 8
    gu = (torch.randn(m, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).bfloat16().float()
    gu[0, : min(inter, 4)] = torch.tensor([-100.0, 100.0, 0.0, -0.0])[: min(inter, 4)]  # exp's clamp, and zeros
    outs = []
    for wide in (1, 0):
        out = torch.full((m, ip), 0x7FC0, dtype=torch.int16)  # NaN bits: the padding must be written
        assert lib.dflash_gate_pairs(ctypes.c_void_p(gu.data_ptr()), m, inter, gelu, wide,
                                     ctypes.c_void_p(out.data_ptr())) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0][:, inter:] == 0).all()
    ours = outs[0][:, :inter].view(torch.bfloat16).float()
    gate, up = gu[:, :inter].bfloat16(), gu[:, inter:].bfloat16()
    act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
    theirs = (act * up).float()
    # (GELU's far negative tail, under 1e-4, comes out another way than torch's 1 + tanh: an absolute margin)
    assert ((ours - theirs).abs() <= 2 ** -6 * theirs.abs() + 1e-4).all()


@needs_native
def test_a_product_loads_the_library_itself():
    """A script that lays out tiles and multiplies, with nothing having loaded the library first, gets our product,
    not None (tiles() of a float32 weight does not load it)."""
    import subprocess
    import sys

    code = ("import torch\nfrom dflash.models import native\nw = torch.randn(30, 16)\n"
            "y = native.linear(torch.ones(2, 16), native.tiles(w), 30, None)\n"
            "assert y is not None and torch.allclose(y, torch.ones(2, 16) @ w.T, atol=1e-5)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.skipif(not amx_runs_here(), reason="no AMX here")
@pytest.mark.parametrize("setting", ["1", "0"])
def test_attention_tiles_follow_their_environment_switch_and_name_the_build(setting):
    """DFLASH_ATTENTION_TILES=0 keeps attention in VDPBF16PS where products run through tiles; the build id says
    which runs ("+atiles"), so kernel plans measured under one are not taken for the other."""
    import os
    import subprocess
    import sys

    code = ("from dflash.models import native\nnative.library()\nnative.set_amx(True)\n"
            "print(native.build_id())\nprint(native.set_attention_tiles(False))\n")
    env = dict(os.environ, DFLASH_ATTENTION_TILES=setting)
    build, was_on = subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=env,
                                   capture_output=True, text=True).stdout.split()
    assert ("+atiles" in build) == (setting == "1") and was_on == str(setting == "1")


@needs_native
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_heads_float_outputs_are_its_bfloat16_outputs_widened(bf16_layout, with_bias):
    """FrozenLinear.float_out (the LM head's logits): our kernel writes a bfloat16 product's outputs as float32
    directly, bitwise what the bfloat16 product gives widened, at every row count and through every layout."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 150, generator=g).bfloat16()
    bias = torch.randn(200, generator=g).bfloat16() if with_bias else None
    head = FrozenLinear(weight, bias, NATIVE)
    for m in (1, 2, 5, 8, 16, 17):
        x = torch.randn(m, 150, generator=g).bfloat16()
        assert head.kernel_for_rows(m) == "native"
        got = head.float_out(x)
        assert got.dtype == torch.float32 and torch.equal(got, head(x).float()), m
    float32_head = FrozenLinear(weight.float(), None, NATIVE)
    x = torch.randn(3, 150, generator=g)
    assert torch.equal(float32_head.float_out(x), float32_head(x))
