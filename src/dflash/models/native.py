"""Our own CPU kernels (native.c and its parts, native/*.c: one translation unit), compiled on first use with the
machine's C compiler.

Two things, both for passes of a few tokens (a decode step, a verify pass), where torch's CPU path was far from the
hardware: a matrix product that reads weights near the memory bandwidth (torch's kernels read SmolLM2's 1-7 MB
matrices at about half of it, docs/RESULTS.md), and whole Llama/Qwen decoder layers, one or all of a model's in one
call (between its products, ~25 small torch ops a layer had cost about as much as the products). The product is one
more candidate for kernels.py, chosen per shape where it measures faster; a layer runs in C where the plan chose it
for all four of the layer's products (transformer.py). Built only on x86-64 Linux CPUs with AVX2 and FMA, with a C compiler
(`$CC`, else `cc`) and OpenMP; anything else (or DFLASH_NATIVE=0) leaves it out, and torch's kernels run.
The shared library is cached under the dflash cache by a hash of source (`source_text`: native.c with its parts in
place), flags and compiler, so it is built once.
Where the CPU multiplies bfloat16 itself (AVX512-BF16: AMD Zen 4, Intel Sapphire Rapids), bfloat16 weights are laid
out in pairs of inputs for it (`bf16_pairs`; DFLASH_BF16_PAIRS=0 keeps the widening kernel); where it also has AMX
tiles (Intel Sapphire Rapids and later) and they measure faster, products in pairs run through them (`amx`;
DFLASH_AMX=0 keeps VDPBF16PS). An int8 target's products read its weights a byte each wherever the kernel runs
(`int8_kernel`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from . import memory

SOURCE = Path(__file__).with_name("native.c")
PART = re.compile(rb'^#include "(native/[A-Za-z0-9_]+\.c)".*$', re.MULTILINE)  # native.c's parts, in order
PANEL = 24  # output rows per panel of the layout (native.c)
VNNI_GROUP = 16  # rows per group of the int8 screen's integer layout (native.c)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
_library: ctypes.CDLL | None = None
_tried = False
_pairs = False  # bfloat16 weights laid out in pairs (see bf16_pairs)
_amx = False  # products in pairs through AMX tiles (see amx)
_int8_on = True  # our products read int8 weights a byte each, where a kernel for them runs (see int8_kernel)
_int8_pairs = False  # ... in pairs, where bfloat16 weights are in pairs (AVX512-VBMI; see int8_kernel)
_int8_vnni = False  # the int8 screen in integers (see int8_vnni)
_screen_wide = False  # ... its inputs wide where many rows are screened (see screen_wide)
why_not = ""  # why the kernel is unavailable, for reports


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")  # what kernels can use


def cpu_description() -> dict:
    """The CPU by name, and which of the instruction sets our kernels (or oneDNN's) use it has: what a speed figure
    depends on, for reports."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"model": platform.processor() or platform.machine(), "isa": []}
    field = lambda name: next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(name)), "")  # noqa: E731
    flags = set(field("flags").split())
    return {"model": field("model name") or platform.machine(), "family": field("cpu family"),
            "model_number": field("model\t"), "isa": [f for f in ISA_FLAGS if f in flags]}


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx2" in flags and "fma" in flags


def source_text(read: Callable[[str], bytes] | None = None) -> bytes:
    """The kernels' source as one file: native.c with each part (native/*.c) in place of its #include line, the
    tokens the compiler reads. The build's cache key hashes it, so a change to any part builds anew; an A/B run
    builds another revision's from it (scripts/native_source.py). `read(path)`: a file by its path relative to
    native.c's folder, "native.c" itself first; by default SOURCE and the parts beside it."""
    if read is None:  # (SOURCE may be another name: an A/B run's old.c)
        read = lambda path: (SOURCE if path == "native.c" else SOURCE.parent / path).read_bytes()  # noqa: E731
    return PART.sub(lambda m: read(m[1].decode()).rstrip(b"\n"), read("native.c"))


def build_key(compiler_version: str) -> str:
    """The built library's name in the cache: a hash of the source with its parts, the flags and the compiler."""
    return hashlib.sha256(source_text() + " ".join(FLAGS).encode() + compiler_version.encode()).hexdigest()[:16]


def _build(compiler: str) -> Path:
    from ..hub import cache_dir

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = build_key(version)
    target = cache_dir() / "native" / f"dflash_native_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise OSError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "compiler failed")
        os.replace(built, target)  # atomic: a concurrent process sees the old state or the whole file
    return target


_I, _L, _P, _F, _D = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
# The library's entry points and their argument types (each returns an int). Those in _OPTIONAL are absent from
# builds of older sources, which load too (A/B runs against an old commit's kernels).
_SIGNATURES = {
    "dflash_linear_f32": [_P] * 4 + [_L] * 3 + [_I],
    "dflash_linear_bf16": [_P] * 4 + [_L] * 3 + [_I] * 3,
    "dflash_bf16_pairs": [], "dflash_int8_vnni": [], "dflash_int8_pairs": [], "dflash_amx": [],
    "dflash_screen_tiles": [], "dflash_f32_kernel": [],
    "dflash_set_amx": [_I], "dflash_set_screen_tiles": [_I], "dflash_set_f32_kernel": [_I],
    "dflash_set_narrow_passes": [_I] * 2, "dflash_set_attention_pairs": [_I],
    "dflash_set_scores_two": [_I], "dflash_set_values_in_registers": [_I], "dflash_set_attention_tiles": [_I],
    "dflash_set_wide_exponentials": [_I],
    "dflash_gate_pairs": [_P, _L, _L, _I, _I, _P],
    "dflash_int8_quad_logits": [_P] * 3 + [_L] * 3 + [_I] + [_P] * 2 + [_I],
    "dflash_greedy_screened": ([_P, _I] + [_P] * 2 + [_I] + [_P] + [_D] * 2 + [_P] + [_L] * 3 + [_I] + [_P] * 2),
    "dflash_greedy_screened_normed": ([_P, _I] + [_P] * 2 + [_I] + [_P] + [_D] * 2 + [_P] * 2 + [_F] + [_I] * 2
                                      + [_L] * 3 + [_I] + [_P] * 2),
    "dflash_layer": ([_P] * 2 + [_L] * 2 + [_P] * 5 + [_L] + [_I] * 2 + [_P] * 2 + [_F] + [_P] * 4 + [_F]
                     + [_P] * 4 + [_L] * 5 + [_F] + [_I] * 2 + [_L] + [_P] * 2 + [_L, _I] + [_P] * 2 + [_L]),
    "dflash_stack": ([_P] * 3 + [_L] * 2 + [_P] * 5 + [_L] * 2 + [_I, _L] + [_P] * 2 + [_L, _P]),
    "dflash_drafter_stack": ([_P] * 3 + [_L] * 2 + [_P] * 3 + [_L] + [_P] * 4 + [_L] * 2 + [_I, _L, _P]),
    "dflash_rms_norm": [_P] * 3 + [_L] * 2 + [_F] + [_I] * 2,
}
_OPTIONAL = {"dflash_set_scores_two", "dflash_set_values_in_registers", "dflash_set_attention_tiles",
             "dflash_set_wide_exponentials", "dflash_gate_pairs"}


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on the first call; None where it cannot be (see `why_not`)."""
    global _library, _tried, why_not
    if _tried:
        return _library
    _tried = True
    if os.environ.get("DFLASH_NATIVE", "1") == "0":
        why_not = "DFLASH_NATIVE=0"
    elif platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        why_not = f"not built for {platform.system()} {platform.machine()}"
    elif not _cpu_has_avx2_fma():
        why_not = "this CPU lacks AVX2/FMA"
    elif not (compiler := shutil.which(os.environ.get("CC", "cc"))):
        why_not = "no C compiler"
    else:
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
            _declare(lib)
            _library = lib
            _choose_settings(lib)
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:  # AttributeError: a symbol is missing
            _library, why_not = None, f"build failed: {exc}"
    if _library is None and why_not.startswith(("build failed", "no C compiler")):
        # a CPU our kernels would have run on: say so once, or a run is several times slower without a word
        print(f"[dflash] our CPU kernels are not running here ({why_not}): torch's kernels run instead, several "
              "times slower on a CPU (set CC to a C compiler with OpenMP, or DFLASH_NATIVE=0 to silence this)",
              file=sys.stderr)
    return _library


def _declare(lib: ctypes.CDLL) -> None:
    """Argument and result types of every entry point (_SIGNATURES); AttributeError where one is missing"""
    for name, argtypes in _SIGNATURES.items():
        if name in _OPTIONAL and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int


def _choose_settings(lib: ctypes.CDLL) -> None:
    """What this CPU and build can do, less what the environment turns off; AMX and 512-bit float32 kernels only
    where they measure faster here."""
    global _pairs, _int8_vnni, _screen_wide, _int8_on, _int8_pairs, _attention_tiles
    if hasattr(lib, "dflash_set_attention_tiles"):
        _attention_tiles = os.environ.get("DFLASH_ATTENTION_TILES", "1") != "0"
        lib.dflash_set_attention_tiles(int(_attention_tiles))
    _pairs = bool(lib.dflash_bf16_pairs()) and os.environ.get("DFLASH_BF16_PAIRS", "1") != "0"
    _int8_on = os.environ.get("DFLASH_INT8", "1") != "0"
    _int8_pairs = bool(lib.dflash_int8_pairs()) and os.environ.get("DFLASH_INT8_PAIRS", "1") != "0"
    _int8_vnni = bool(lib.dflash_int8_vnni()) and os.environ.get("DFLASH_INT8_VNNI", "1") != "0"
    _screen_wide = _int8_vnni and os.environ.get("DFLASH_SCREEN_WIDE", "1") != "0"
    if _pairs and lib.dflash_amx() and os.environ.get("DFLASH_AMX", "1") != "0":
        set_amx(_amx_measures_faster())
        set_screen_tiles(_amx and bool(lib.dflash_screen_tiles()))
    if lib.dflash_f32_kernel() >= 1 and os.environ.get("DFLASH_F32_ZMM", "1") != "0":
        set_f32_kernel("avx512-zmm" if _zmm_measures_faster() else "avx512")


def build_id() -> str:
    """Which build of the kernel runs here ("none" where none does): its file name carries the source hash,
    "+pairs" where bfloat16 products run in pairs ("+amx" through AMX tiles, "+atiles" with attention through them
    too), "+zmm" where float32 ones run in 512-bit code, "+vnni" where the int8 screen sums in integers, and "+wide"
    where its inputs may be wide."""
    lib = library()
    if lib is None:
        return "none"
    int8 = {"pairs": "+int8", "widened": "+int8w", None: ""}[int8_kernel()]
    return (Path(lib._name).stem + ("+pairs" if _pairs else "") + ("+amx" if _amx else "")
            + ("+zmm" if f32_kernel() == "avx512-zmm" else "") + ("+tiles8" if _screen_tiles else "")
            + ("+atiles" if _amx and _attention_tiles else "") + int8
            + ("+vnni" if _int8_vnni else "")
            + ("+wide" if _screen_wide else ""))


def bf16_pairs() -> bool:
    """Whether bfloat16 weights are laid out in pairs of inputs for VDPBF16PS (native.c): where this build and CPU
    have it, unless DFLASH_BF16_PAIRS=0."""
    library()
    return _pairs


def set_bf16_pairs(on: bool) -> bool:
    """Switches the layout of bfloat16 weights laid out from now on (for tests and A/B runs); returns the old
    setting. Weights laid out before keep theirs, and every call reads the layout from the tiles it gets."""
    global _pairs
    lib, old = library(), _pairs
    if on and (lib is None or not lib.dflash_bf16_pairs()):
        raise RuntimeError("this build or CPU cannot multiply bfloat16 in pairs (AVX512-BF16)")
    _pairs = bool(on)
    return old


def amx() -> bool:
    """Whether products in pairs (bfloat16 and int8 weights, `bf16_pairs`) run through AMX tiles (TDPBF16PS) rather
    than VDPBF16PS chains: where this build, CPU and OS have them, DFLASH_AMX is not 0, and they measured faster
    when the library loaded (`_amx_measures_faster`). The two kernels sum in different orders, so outputs differ in
    their last bits between them; a pass never mixes them."""
    library()
    return _amx


def set_amx(on: bool) -> bool:
    """Switches products in pairs to AMX tiles or back to VDPBF16PS (for tests and A/B runs; the tiles are the same,
    so weights laid out before follow); returns the old setting. Switch between passes, never during one."""
    global _amx
    lib, old = library(), _amx
    if on and (lib is None or not lib.dflash_amx()):
        raise RuntimeError("this build, CPU or OS cannot run AMX tiles (AMX-BF16)")
    if lib is not None:
        lib.dflash_set_amx(int(on))
    _amx = bool(on)
    return old


def _faster_way(switch, ways: tuple, dtype: torch.dtype, rows: tuple[int, ...], repeats: int, **layout):
    """Which of two `ways` (each passed to `switch`) ran products of `rows` rows in less time here: summed over a
    random [3072, 576] weight of `dtype`, SmolLM2's gate/up (beyond L2), the fastest of `repeats` interleaved runs of
    each. The tiles are plain tensors (`lasting=False`): freed into a huge-page arena they would stay resident."""
    import time

    generator = torch.Generator().manual_seed(0)
    weight_tiles = tiles(torch.randn(3072, 576, generator=generator).to(dtype), lasting=False, **layout)
    inputs = [torch.randn(m, 576, generator=generator).to(dtype) for m in rows]
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeats):
        for way in ways:
            switch(way)
            start = time.perf_counter()
            for x in inputs:
                linear(x, weight_tiles, 3072, None)
            best[way] = min(best[way], time.perf_counter() - start)
    return min(ways, key=best.get)


def _amx_measures_faster(rows: tuple[int, ...] = (1, 16), repeats: int = 5) -> bool:
    """Whether AMX tiles ran a product in pairs faster than VDPBF16PS here, at a step's and a verify pass's rows
    (`_faster_way`, bfloat16: 3.5 MB). About 20 ms. On an Intel Xeon (family 6 model 207, 2 threads) tiles took
    ~0.8x the time at one row and ~0.25x at sixteen."""
    try:
        return _faster_way(set_amx, (True, False), torch.bfloat16, rows, repeats, pairs=True)
    finally:
        set_amx(False)


F32_KERNELS = ("avx2", "avx512", "avx512-zmm")  # native.c's dflash_set_f32_kernel, by number


def f32_kernel() -> str | None:
    """Which kernel sums float32 panels (and bfloat16 ones widened to float32): "avx2" (256-bit code, 4 rows a
    group), "avx512" (256-bit AVX-512VL code, 8 rows a group) or "avx512-zmm" (a panel's columns 0-15 in one 512-bit
    register, 16-23 in a 256-bit one: two FMAs an input of a row where the others take three), the last two where
    the CPU has AVX-512VL, whichever measured faster when the library loaded (`_zmm_measures_faster`) unless
    DFLASH_F32_ZMM=0. Each sums every output as the same one chain of FMAs: outputs are bitwise the same with any
    of them. None where our kernels do not run."""
    lib = library()
    return None if lib is None else F32_KERNELS[lib.dflash_f32_kernel()]


def set_f32_kernel(name: str) -> str | None:
    """Switches the float32 panels' kernel (`f32_kernel`; for tests and A/B runs); returns the old one."""
    lib = library()
    if name not in F32_KERNELS:
        raise ValueError(f"unknown float32 kernel {name!r}: one of {', '.join(F32_KERNELS)}")
    if lib is None:
        raise RuntimeError(f"our kernels do not run here: {why_not}")
    old = f32_kernel()
    if lib.dflash_set_f32_kernel(F32_KERNELS.index(name)) != F32_KERNELS.index(name):
        lib.dflash_set_f32_kernel(F32_KERNELS.index(old))
        raise RuntimeError(f"this CPU cannot run the {name} kernel (AVX-512VL)")
    return old


def f32_kernels_here() -> list[str]:
    """The float32 kernels this CPU runs (`f32_kernel`)."""
    lib = library()
    if lib is None:
        return []
    old = lib.dflash_f32_kernel()
    here = F32_KERNELS[:lib.dflash_set_f32_kernel(2) + 1]
    lib.dflash_set_f32_kernel(old)
    return list(here)


def _zmm_measures_faster(rows: tuple[int, ...] = (8, 16), repeats: int = 7) -> bool:
    """Whether 512-bit code ran float32 products of `rows` rows faster than 256-bit AVX-512VL code here
    (`_faster_way`, float32: 7 MB). A step (one row) reads two panels at a time in 256-bit code either way. About
    15 ms."""
    old = f32_kernel()
    try:
        return _faster_way(set_f32_kernel, ("avx512-zmm", "avx512"), torch.float32, rows, repeats) == "avx512-zmm"
    finally:
        set_f32_kernel(old)


# (two_panel_rows, request_from_rows): native.c; a step (one row) reads two panels at a time either way
NARROW_PASSES = {"two-panels": (4, 7), "one-panel": (1, 2)}
_narrow = "two-panels"


def narrow_passes() -> str:
    """How products of a few rows read the panels (native.c, dflash_set_narrow_passes): "two-panels" (up to 4 rows
    two panels at a time, a single group requesting the next chunk from 7 rows: AMD EPYC Zen 3 and 4) or
    "one-panel" (2 rows and more one panel at a time, requesting from 2 rows: an Intel Xeon with AVX-512); a step
    reads two panels at a time either way. Chosen per machine by
    target.choose_narrow_passes; every output is the same one chain either way."""
    return _narrow


def set_narrow_passes(way: str) -> str:
    """Switches how narrow products read the panels (`narrow_passes`); returns the old way."""
    global _narrow
    lib, old = library(), _narrow
    if way not in NARROW_PASSES:
        raise ValueError(f"unknown way {way!r}: one of {', '.join(NARROW_PASSES)}")
    if lib is not None:
        lib.dflash_set_narrow_passes(*NARROW_PASSES[way])
    _narrow = way
    return old


def int8_kernel() -> str | None:
    """How our products read int8 weights (an int8 target's, `--dtype int8`), a byte each: "pairs" (native.c,
    INT8_PAIRS: VDPBF16PS over the integers' bfloat16 values) where bfloat16 weights are in pairs and the CPU has
    AVX512-VBMI, "widened" (INT8_WIDENED: each integer widened to float32 for an FMA) where bfloat16 weights are
    widened too (AVX2 CPUs: AMD Zen 2 and 3, most Intel client chips). Either scales each output after its sum.
    None where the kernel does not run, where DFLASH_INT8=0 (or DFLASH_INT8_PAIRS=0 on a CPU that would pair them),
    or on a CPU with AVX512-BF16 but not VBMI: such a model then runs the bfloat16 weights its int8 ones stand
    for. It follows the bfloat16 layout (`set_bf16_pairs`), so the two always match."""
    if library() is None or not _int8_on:
        return None
    if _pairs:
        return "pairs" if _int8_pairs else None
    return "widened"


def set_int8_kernels(on: bool) -> bool:
    """Switches whether int8 weights laid out from now on are read a byte each (`int8_kernel`) or as the bfloat16
    values they stand for (for tests and A/B runs); returns the old setting."""
    global _int8_on
    old = _int8_on
    if on and library() is None:
        raise RuntimeError("no kernel library here: int8 weights run as their bfloat16 values")
    _int8_on = bool(on)
    return old


def set_attention_pairs(on: bool) -> bool:
    """Whether a bfloat16 model whose products run in pairs also runs attention's scores and value sums with
    VDPBF16PS (native.c; the default: the weights rounded to bfloat16 for the value sums) or with FMAs over widened
    keys and values (for A/B runs); returns the old setting. Outputs may differ in the last bits between the two,
    as between the two product kernels."""
    lib = library()
    if lib is None:
        raise RuntimeError("no kernel library here")
    return bool(lib.dflash_set_attention_pairs(int(on)))


def set_attention_tiles(on: bool) -> bool:
    """Whether a bfloat16 model whose products run through AMX tiles (`amx`) runs attention's scores and value sums
    through them too (native.c's tile_scores and tile_values; the default, off with DFLASH_ATTENTION_TILES=0) or
    with VDPBF16PS (for tests and A/B runs); returns the old setting. Tiles sum blocks of pairs at once, so outputs
    may differ in the last bits between the two."""
    global _attention_tiles
    lib = library()
    if lib is None:
        raise RuntimeError("no kernel library here")
    _attention_tiles = bool(on)
    return bool(lib.dflash_set_attention_tiles(int(on)))


def set_values_in_registers(on: bool) -> bool:
    """Whether attention sums its values for several query heads at once in AVX-512 registers (native.c's
    values64; the default where the CPU has AVX-512F) or head by head over a widened copy (for tests and A/B runs);
    returns the old setting. Outputs are bitwise the same either way."""
    lib = library()
    if lib is None:
        raise RuntimeError("no kernel library here")
    return bool(lib.dflash_set_values_in_registers(int(on)))


def set_scores_two(on: bool) -> bool:
    """Whether attention scores two queries at once in AVX-512 registers where it runs in float32 (native.c's
    block_scores_two; the default where the CPU has AVX-512F) or query by query (for tests and A/B runs); returns
    the old setting. Outputs are bitwise the same either way."""
    lib = library()
    if lib is None:
        raise RuntimeError("no kernel library here")
    return bool(lib.dflash_set_scores_two(int(on)))


def int8_vnni() -> bool:
    """Whether int8 screens of the LM head (and drafters' int8 heads) sum in integers with VPDPBUSD (native.c):
    where this build and CPU have AVX512-VNNI, unless DFLASH_INT8_VNNI=0."""
    library()
    return _int8_vnni


def set_int8_vnni(on: bool) -> bool:
    """Switches how int8 screens made from now on sum (for tests and A/B runs); returns the old setting."""
    global _int8_vnni
    lib, old = library(), _int8_vnni
    if on and (lib is None or not lib.dflash_int8_vnni()):
        raise RuntimeError("this build or CPU cannot sum the int8 screen in integers (AVX512-VNNI)")
    _int8_vnni = bool(on)
    return old


_screen_tiles = False
_attention_tiles = False  # attention through tiles where products run through them (set_attention_tiles)


def screen_tiles() -> bool:
    """Whether the int8 screen (`int8_vnni`) of more than one row sums through AMX tiles (TDPBSUD, AMX-INT8): the
    same integer sums as VPDPBUSD's, so the same logits bitwise, in less time where the CPU has them (Intel Sapphire
    Rapids and later), unless DFLASH_AMX=0."""
    library()
    return _screen_tiles


def set_screen_tiles(on: bool) -> bool:
    """Switches the int8 screen through AMX tiles on or off (`screen_tiles`; for tests and A/B runs); returns the
    old setting."""
    global _screen_tiles
    lib, old = library(), _screen_tiles
    if lib is None:
        if on:
            raise RuntimeError(f"our kernels do not run here: {why_not}")
        return old
    if on and not lib.dflash_screen_tiles():
        raise RuntimeError("this build, CPU or OS cannot run the int8 screen through AMX tiles (AMX-INT8, VNNI)")
    lib.dflash_set_screen_tiles(int(on))
    _screen_tiles = bool(on)
    return old


def screen_wide() -> bool:
    """Whether integer screens of the LM head round their inputs wide where many rows are screened (native.c, "the
    int8 screen in integers": all but a row's 8 largest channels in a byte; else dense, every channel in two):
    wherever int8_vnni holds, unless DFLASH_SCREEN_WIDE=0."""
    library()
    return _screen_wide


def set_screen_wide(on: bool) -> bool:
    """Switches whether integer screens made from now on may round their inputs wide (for tests and A/B runs);
    returns the old setting."""
    global _screen_wide
    lib, old = library(), _screen_wide
    if on and (lib is None or not lib.dflash_int8_vnni()):
        raise RuntimeError("this build or CPU cannot sum the int8 screen in integers (AVX512-VNNI)")
    _screen_wide = bool(on)
    return old


def int8_rows(weight: torch.Tensor, rows_at_once: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized int8 [n, k], scales float32 [n]) with weight ~ scales[:, None] * quantized: each row rounded to
    nearest on its own symmetric scale (its largest magnitude / 127). `rows_at_once` rows at a time, each as a whole
    call would round it: over SmolLM2's whole float32 head (the int8 screen, made at the first greedy round) the
    float32 temporaries had raised a generation's peak memory by ~330 MB."""
    weight = weight.detach()
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows_at_once):
        rows = weight[start:start + rows_at_once].float()
        scale = (rows.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        scales[start:start + rows_at_once] = scale
        quantized[start:start + rows_at_once] = torch.round(rows / scale[:, None]).clamp_(-127, 127)
    return quantized, scales


def vnni_tiles(quantized: torch.Tensor) -> torch.Tensor:
    """The integer kernel's layout of int8 weights [n, k] (native.c): each weight plus 128 as a byte (VPDPBUSD reads
    them unsigned), zero weights padding to 16 rows and to k a multiple of 4, cut into groups of 16 rows, each
    stored four inputs at a time ([groups, k4 / 4, 16, 4]), so that one 64-byte load holds the sixteen rows' four
    inputs."""
    n, k = quantized.shape
    padded = torch.nn.functional.pad(quantized.detach(), (0, -k % 4, 0, -n % VNNI_GROUP)).to(torch.int16) + 128
    groups = padded.to(torch.uint8).view(padded.shape[0] // VNNI_GROUP, VNNI_GROUP, padded.shape[1] // 4, 4)
    groups = groups.transpose(1, 2)
    return memory.lasting(tuple(groups.shape), groups.dtype).copy_(groups)


def int8_vnni_logits(x: torch.Tensor, head) -> tuple[torch.Tensor, torch.Tensor]:
    """(approximate logits [m, n], each row's input rounding term [m]) of float32 rows x [m, k] through the integer
    screen of `head`, its inputs wide or dense as `head.wide_inputs` says for m rows: what its bound is about, for
    tests."""
    if library() is None or not head.vnni:
        raise RuntimeError("no VNNI screen here")
    return vnni_product(x, head.tiles, head.scales, head.weight.shape[0], head.wide_inputs(x.shape[0]))


def vnni_product(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, n: int, wide: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W^T float32 [m, n], each row's input rounding term [m]) of rows x [m, k] (float32 or bfloat16) against
    int8 rows W ~ scales * quantized laid out by `vnni_tiles`, summed in integers against x rounded per row, dense
    (every channel to int16, in two bytes) or wide (native.c, dflash_int8_quad_logits; AVX512-VNNI). Inexact: for
    screens and drafters."""
    x = x.float().contiguous()
    m, k = x.shape
    out, spread = torch.empty(m, n), torch.empty(m, dtype=torch.float64)
    if m == 0:  # (C would ask for no memory, which may come back NULL)
        return out, spread
    if library().dflash_int8_quad_logits(tiles.data_ptr(), scales.data_ptr(), x.data_ptr(), m, n, k,
                                         torch.get_num_threads(), out.data_ptr(), spread.data_ptr(), int(wide)):
        raise MemoryError("out of memory in the VNNI kernel")
    return out, spread


def supports(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and library() is not None)


def tiles(weight: torch.Tensor, pairs: bool | None = None, lasting: bool = True) -> torch.Tensor:
    """The kernel's layout of `weight` [n, k] (see native.c): zero-padded to 24-row, 8-column multiples, then cut
    into panels of 24 rows, each stored column by column ([panels, k8, 24]), so that a panel is one sequential
    stream and each of its inputs meets 24 weights side by side. A bfloat16 weight in pairs (`pairs`, default
    `bf16_pairs()`) keeps two adjacent inputs of a column together: [panels, k8 / 2, 24, 2]. `lasting`: on the
    huge-page arenas of a model's weights (memory.lasting); else a plain tensor, for tiles soon freed."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, -k % 8, 0, -n % PANEL))
    panels = padded.view(padded.shape[0] // PANEL, PANEL, padded.shape[1]).transpose(1, 2)
    if weight.dtype == torch.bfloat16 and (bf16_pairs() if pairs is None else pairs):
        panels = panels.reshape(panels.shape[0], panels.shape[1] // 2, 2, PANEL).transpose(2, 3)
    if not lasting:  # (freed into an arena, it would stay resident beside the model's tiles)
        return panels.contiguous()
    return memory.lasting(tuple(panels.shape), panels.dtype).copy_(panels)  # streamed every pass: on huge pages


def untiled(weight_tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weight [n, k] that `tiles` laid out as `weight_tiles` (either layout), bitwise, in a fresh tensor."""
    panels = weight_tiles
    if in_pairs(panels):  # [panels, k8 / 2, 24, 2] -> [panels, k8, 24]
        panels = panels.transpose(2, 3).reshape(panels.shape[0], panels.shape[1] * 2, PANEL)
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n, :k].contiguous()


INT8_SMALLEST_SCALE = 2.0 ** -100  # keeps every q * scale a normal float (VCVTNEPS2BF16 flushes subnormals)


def int8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], scales float32 [n], the weight they stand for, bfloat16 [n, k]) of a weight [n, k]: each row
    rounded to nearest on its own symmetric scale (its largest magnitude / 127), the weight w' = bf16(q * scale) as
    torch rounds a float32 product to bfloat16, which is what native.c's int8 kernels multiply by (`int8_tiles`).
    A model whose weights are replaced by w' is the int8 model, whichever form its products read."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(INT8_SMALLEST_SCALE)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales, int8_approximation(q, scales)


def int8_approximation(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weight w' = bf16(q * scale) that int8 rows q with their `scales` stand for (`int8_weights`)."""
    return (q.float() * scales[:, None]).to(torch.bfloat16)


def int8_pair_tiles(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """native.c's layout of int8 weights q (in [-127, 127]) in pairs (INT8_PAIRS), a view [panels, k8 / 2, 24, 2] of
    int8 whose buffer goes on past its end with each panel's 24 scales (float32 [panels, 24]). The bytes are the
    bfloat16 pairs layout of `tiles` (for input pair j, the 24 columns' two weights), a byte each as sign (bit 7) and
    magnitude, reordered within each run of four input pairs (units) as three blocks of 64 bytes, each two vectors
    of 32 weights that native.c's unpacking puts back (vector h's weight 8l + j at byte 16l + 8h + j): units 0 and
    1's columns 0-15, units 2 and 3's, then columns 16-23 of units 0 and 1, and of units 2 and 3. Half the bytes of
    the bfloat16 tiles."""
    n, k = q.shape
    magnitude = q.detach().to(torch.int16).abs()
    coded = (magnitude | (q.detach() < 0).to(torch.int16) << 7).to(torch.uint8).view(torch.int8)  # sign, magnitude
    padded = torch.nn.functional.pad(coded, (0, -k % 8, 0, -n % PANEL))
    count, k8 = padded.shape[0] // PANEL, padded.shape[1]
    panels = padded.view(count, PANEL, k8).transpose(1, 2).reshape(count, k8 // 2, 2, PANEL).transpose(2, 3)
    runs = panels.reshape(count, k8 // 8, 4, PANEL * 2)  # [count, runs, unit, 24 columns x 2 inputs]
    low, high = runs[..., :32], runs[..., 32:]  # columns 0-15 of each unit, then 16-23
    vectors = torch.stack([low[:, :, 0], low[:, :, 1], low[:, :, 2], low[:, :, 3],
                           high[:, :, 0:2].flatten(2), high[:, :, 2:4].flatten(2)], dim=2)  # [count, runs, 6, 32]
    blocks = vectors.view(count, k8 // 8, 3, 2, 4, 8).transpose(3, 4)  # (h, lane, j) -> (lane, h, j)
    weight_bytes = count * PANEL * k8
    buffer = memory.lasting((weight_bytes + count * PANEL * 4,), torch.int8)
    buffer[weight_bytes:].view(torch.float32).copy_(torch.nn.functional.pad(scales.float(), (0, -n % PANEL)))
    view = buffer[:weight_bytes].view(count, k8 // 2, PANEL, 2)
    view.view(blocks.shape).copy_(blocks)
    return view


def int8_widened_tiles(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """native.c's layout of int8 weights q (in [-127, 127]) for the widening kernel (INT8_WIDENED): `tiles`' float32
    layout with a byte a weight, [panels, k8, 24] int8, whose buffer goes on past its end with each panel's 24 scales
    (float32 [panels, 24]), as int8_pair_tiles' does. A quarter of the float32 tiles' bytes, half the bfloat16's."""
    n, k = q.shape
    padded = torch.nn.functional.pad(q.detach(), (0, -k % 8, 0, -n % PANEL))
    count, k8 = padded.shape[0] // PANEL, padded.shape[1]
    weight_bytes = count * PANEL * k8  # a multiple of 4 (k8 is of 8): the scales stay aligned
    buffer = memory.lasting((weight_bytes + count * PANEL * 4,), torch.int8)
    buffer[weight_bytes:].view(torch.float32).copy_(torch.nn.functional.pad(scales.float(), (0, -n % PANEL)))
    view = buffer[:weight_bytes].view(count, k8, PANEL)
    view.copy_(padded.view(count, PANEL, k8).transpose(1, 2))
    return view


def int8_tiles(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The layout of int8 weights q with their rows' scales for this machine's `int8_kernel` (which must run)."""
    kernel = int8_kernel()
    if kernel is None:
        raise RuntimeError("our kernels do not read int8 weights here")
    return int8_pair_tiles(q, scales) if kernel == "pairs" else int8_widened_tiles(q, scales)


def in_pairs(weight_tiles: torch.Tensor) -> bool:
    return weight_tiles.dim() == 4


def tiles_dtype(weight_tiles: torch.Tensor) -> torch.dtype:
    """The dtype of the inputs and outputs a layout's products take: int8 tiles' are bfloat16."""
    return torch.bfloat16 if weight_tiles.dtype == torch.int8 else weight_tiles.dtype


def tile_inputs(weight_tiles: torch.Tensor) -> int:
    """The inputs (k8) of a weight laid out by `tiles`."""
    return weight_tiles.shape[1] * (2 if in_pairs(weight_tiles) else 1)


def linear(x: torch.Tensor, weight_tiles: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           float_out: bool = False) -> torch.Tensor | None:
    """x W^T + b, W given as `tiles(W)` with `out_features` rows; None where the kernel does not apply (the caller
    then uses torch's). `float_out`: a bfloat16 product's outputs as float32, bitwise its bfloat16 outputs widened
    (an LM head's logits, written so as they land rather than converted twice)."""
    lib = _library if _tried else library()  # (a caller that laid out tiles(w, pairs=...) may not have loaded it)
    k = x.shape[-1]
    if (lib is None or x.dtype != tiles_dtype(weight_tiles) or (bias is not None and not bias.is_contiguous())
            or -(-k // 8) * 8 != tile_inputs(weight_tiles)):  # a wrong width: torch's kernel says so, we would read past
        return None
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32 if float_out else x.dtype)
    args = (weight_tiles.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            x.numel() // k, out_features, k, torch.get_num_threads())
    if x.dtype == torch.float32:
        status = lib.dflash_linear_f32(*args)
    else:  # native.c's layouts: bfloat16, bfloat16 in pairs, int8 in pairs, int8 widened
        pairs = in_pairs(weight_tiles)
        layout = (2 if pairs else 3) if weight_tiles.dtype == torch.int8 else int(pairs)
        status = lib.dflash_linear_bf16(*args, layout, int(float_out))
    return y if status == 0 else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def layer_constants(weights: dict, shape: dict, dtype: torch.dtype) -> tuple:
    """The arguments of a decoder layer that do not change between calls (see native.c), made once: `weights`
    holds its norms and biases (tensors in the model dtype, or None) and its products' tiles, `shape` its sizes and
    constants. The tensors must outlive the tuple (the caller keeps them). The first, native.c's `bf16`: 0 float32,
    1 bfloat16, 2 bfloat16 with its products' tiles in pairs (all four are laid out alike). Gemma3's layers add
    `gemma` (unit-offset norms), `gelu`, a sliding `window`, norms 3 and 4 (sandwich) and their RoPE table's index
    `rope` (shape's keys; absent: a Llama/Qwen layer). The last, `int8`: its products' tiles hold int8 weights
    (`int8_tiles`; all four alike, in a bfloat16 layer: in pairs where it is in pairs, else widened)."""
    bf16 = 0 if dtype != torch.bfloat16 else 2 if in_pairs(weights["qkv"]) else 1
    return (bf16, _ptr(weights["norm1"]), _ptr(weights["norm2"]), shape["eps"],
            _ptr(weights["qkv"]), _ptr(weights["qkv_bias"]), _ptr(weights["q_norm"]), _ptr(weights["k_norm"]),
            shape["qk_eps"], _ptr(weights["o"]), _ptr(weights["o_bias"]), _ptr(weights["gate_up"]),
            _ptr(weights["down"]), shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"],
            shape["intermediate"], shape["scale"], int(shape.get("gemma", False)), int(shape.get("gelu", False)),
            shape.get("window") or 0, _ptr(weights.get("norm3")), _ptr(weights.get("norm4")), shape.get("rope", 0),
            int(weights["qkv"].dtype == torch.int8))


def layer(h: torch.Tensor, constants: tuple, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
          values: torch.Tensor, starts: torch.Tensor, qkv_rows: torch.Tensor | None = None,
          tree: torch.Tensor | None = None, tree_back: int = 0) -> torch.Tensor | None:
    """One Llama/Qwen decoder layer over n new tokens of each of b sequences (native.c): h [b, n, hidden] ->
    a new [b, n, hidden]. Row r's tokens sit at positions starts[r].. (int64 [b]) and attend causally to their row
    of `keys` / `values` [b, kv_heads, capacity, head_dim], where their own keys and values are written.
    `qkv_rows` (float32 [b, n, q/k/v width]) is added to each token's q, k and v after their product. `tree`
    (int64 [b, n]): token t instead sees its row's cache before starts[r] - tree_back and, from there, the
    positions whose bits tree[t] sets (tree_back + n <= 64). None where the kernel is not available or cannot do
    it (the caller runs its torch forward)."""
    lib = _library
    if lib is None:
        return None
    out = torch.empty_like(h)
    rows = None if qkv_rows is None else qkv_rows.float().contiguous()
    tree = None if tree is None else tree.to(torch.int64).contiguous()  # held here while the call reads it
    status = lib.dflash_layer(h.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], starts.data_ptr(),
                              rope[0].data_ptr(), rope[1].data_ptr(), keys.data_ptr(), values.data_ptr(),
                              keys.shape[2], torch.get_num_threads(), *constants,
                              None if rows is None else rows.data_ptr(),
                              None if tree is None else tree.data_ptr(), tree_back)
    return out if status == 0 else None


class LayerArgs(ctypes.Structure):
    """native.c's `Layer`: one layer's constants, field for field (the order of `layer_constants`' tuple)."""
    _fields_ = [("bf16", ctypes.c_int)] + [(name, ctypes.c_void_p) for name in (
        "norm1", "norm2", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "gate_up", "down")] + [
        (name, ctypes.c_float) for name in ("eps", "qk_eps", "scale")] + [
        (name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "d", "inter")] + [("kv", ctypes.c_void_p)] + [
        ("gemma", ctypes.c_int), ("gelu", ctypes.c_int), ("window", ctypes.c_int64), ("norm3", ctypes.c_void_p),
        ("norm4", ctypes.c_void_p), ("rope", ctypes.c_int64), ("int8", ctypes.c_int)]


def stack_args(constants: list[tuple], context_kv: list[torch.Tensor] | None = None) -> ctypes.Array:
    """Every layer's `layer_constants` as an array of native.c's `Layer` structs, for `stack`; `context_kv`: a
    DFlash drafter's per-layer tiles of its injected-context key/value product (for `drafter_stack`)."""
    def one(c: tuple, kv: torch.Tensor | None) -> LayerArgs:
        (bf16, norm1, norm2, eps, qkv, qkv_bias, q_norm, k_norm, qk_eps, o, o_bias, gate_up, down, hidden, heads,
         kv_heads, d, inter, scale, gemma, gelu, window, norm3, norm4, rope, int8) = c
        return LayerArgs(bf16, norm1, norm2, qkv, qkv_bias, q_norm, k_norm, o, o_bias, gate_up, down, eps, qk_eps,
                         scale, hidden, heads, kv_heads, d, inter, _ptr(kv), gemma, gelu, window, norm3, norm4, rope,
                         int8)
    kvs = context_kv or [None] * len(constants)
    return (LayerArgs * len(constants))(*(one(c, kv) for c, kv in zip(constants, kvs)))


def stack(h: torch.Tensor, layers: ctypes.Array, ropes: list[tuple[torch.Tensor, torch.Tensor]], keys: torch.Tensor,
          values: torch.Tensor, starts: list[int], feature_layers: tuple[int, ...],
          tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Every decoder layer in one call (native.c's dflash_stack): h [b, n, hidden] -> (the last layer's output,
    the outputs of `feature_layers` side by side [b, n, len(feature_layers) * hidden], written there by the call, or
    None for none). ropes: (cos, sin) by layer type, each layer reading its own (its
    constants' `rope`). keys / values: the whole cache [layers, b, kv_heads, capacity, head_dim], each layer's rows
    contiguous. `starts`: each row's first position. `tree`: int64 [b, n] visibility bits of a tree pass
    (`tree_visibility`), None: causal. None where the kernel is not available."""
    lib = _library
    if lib is None:
        return None
    out, spare = torch.empty_like(h), torch.empty_like(h)
    hidden = h.shape[-1]
    features = h.new_empty(*h.shape[:-1], len(feature_layers) * hidden) if feature_layers else None
    # layer i's output lands in its slice of every token's row (a torch.cat of the layers' outputs took ~50 us a pass)
    slot = {i: k for k, i in enumerate(feature_layers)}
    pointers = (ctypes.c_void_p * len(layers))(*(features.data_ptr() + slot[i] * hidden * h.element_size()
                                                 if i in slot else None for i in range(len(layers))))
    coses = (ctypes.c_void_p * len(ropes))(*(cos.data_ptr() for cos, _ in ropes))
    sines = (ctypes.c_void_p * len(ropes))(*(sin.data_ptr() for _, sin in ropes))
    first = (ctypes.c_int64 * len(starts))(*starts)  # each row's first position (not a tensor: a cold torch op)
    status = lib.dflash_stack(h.data_ptr(), out.data_ptr(), spare.data_ptr(), h.shape[0], h.shape[1],
                              ctypes.addressof(first), ctypes.addressof(coses), ctypes.addressof(sines), keys.data_ptr(),
                              values.data_ptr(), keys.stride(0), keys.shape[3], torch.get_num_threads(), len(layers),
                              ctypes.addressof(layers), ctypes.addressof(pointers), len(feature_layers) * hidden,
                              None if tree is None else tree.data_ptr())
    if status != 0:
        return None
    for k, i in enumerate(feature_layers):  # a layer named twice (EAGLE-3 on a shallow target) was written once
        if slot[i] != k:
            features[..., k * hidden: (k + 1) * hidden] = features[..., slot[i] * hidden: (slot[i] + 1) * hidden]
    return out, features


def drafter_stack(h: torch.Tensor, layers: ctypes.Array, rope: tuple[torch.Tensor, torch.Tensor], start: int,
                  context: torch.Tensor, context_rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                  values: torch.Tensor) -> torch.Tensor | None:
    """A DFlash drafter's layers in one call (native.c's dflash_drafter_stack), one sequence: the m new context rows
    `context` [1, m, hidden] (positions start - m..) go into every layer's cache (row 0 of keys / values [layers,
    1, kv_heads, capacity, head_dim]), then the block h [1, n, hidden] (positions start..) attends to that cache and
    to itself in both directions. `layers` from `stack_args` with the context products. Returns the last layer's
    output [1, n, hidden]; None where the kernel is not available."""
    lib = _library
    if lib is None:
        return None
    out, spare = torch.empty_like(h), torch.empty_like(h)
    status = lib.dflash_drafter_stack(h.data_ptr(), out.data_ptr(), spare.data_ptr(), h.shape[1], start,
                                      rope[0].data_ptr(), rope[1].data_ptr(), context.data_ptr(), context.shape[1],
                                      context_rope[0].data_ptr(), context_rope[1].data_ptr(), keys.data_ptr(),
                                      values.data_ptr(), keys.stride(0), keys.shape[3], torch.get_num_threads(),
                                      len(layers), ctypes.addressof(layers))
    return out if status == 0 else None


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm runs on x: float32 or bfloat16 on the CPU, a weight of its dtype, both contiguous."""
    return (_library is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype and x.is_contiguous() and weight.is_contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor | None:
    """x / rms(x) * weight over the last dim of x (float32 or bfloat16, with a weight of its dtype, on the CPU) in one
    C call (native.c, dflash_rms_norm: the layers' own norm; `unit_offset`: Gemma's); None where it cannot run."""
    lib = _library
    if not rms_norm_applies(x, weight):
        return None
    out = torch.empty_like(x)
    status = lib.dflash_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                                 x.shape[-1], eps, int(x.dtype == torch.bfloat16), int(unit_offset))
    return out if status == 0 else None


def greedy_screened(x: torch.Tensor, head, norm=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(argmax ids [m], tokens summed in float32 [m]) of the rows x [m, k] against the float32 head that `head`
    screens (native.c, dflash_greedy_screened); None where it cannot decide (the caller computes the logits). x:
    float32 rows, or with `norm` (an RMSNorm of x's dtype: the model's final norm) the rows before it, in the model's
    dtype, normed in the same call as `norm.rows` norms them (dflash_greedy_screened_normed)."""
    lib = _library
    if lib is None:
        return None
    x = x.contiguous()
    m, k = x.shape
    ids = torch.empty(m, dtype=torch.int64)
    screened = torch.empty(m, dtype=torch.int64)
    int8 = head.scales is not None
    mode = (3 if head.wide_inputs(m) else 2) if head.vnni else int(int8)
    screen = (head.tiles.data_ptr(), mode, head.scales.data_ptr() if int8 else None, head.weight.data_ptr(),
              head.bf16_head, head.bound_norms.data_ptr(), head.norm_factor, head.l1_factor, x.data_ptr())
    rest = (m, head.weight.shape[0], k, torch.get_num_threads(), ids.data_ptr(), screened.data_ptr())
    if norm is None:
        status = lib.dflash_greedy_screened(*screen, *rest)
    else:
        status = lib.dflash_greedy_screened_normed(*screen, norm.weight.data_ptr(), norm.eps,
                                                   int(x.dtype == torch.bfloat16), int(norm.unit_offset), *rest)
    return (ids, screened) if status == 0 else None
