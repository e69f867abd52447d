"""Host buffers on 2 MB pages, for the tensors a pass streams through: weight tiles and KV caches.

Why: a float32 step of SmolLM2-135M reads ~540 MB of weights. On 4 KB pages that is ~130K pages a step, and the TLB
(a few thousand entries) misses on nearly every one. With transparent huge pages in "madvise" mode (a common default)
torch's allocations stay on 4 KB pages, so we map the big buffers ourselves and ask for huge pages. On the 2-core
AMD EPYC Zen 3 CI machine a float32 step got ~5% faster (huge/4K 0.88-1.03, median 0.95, over 7 paired runs of
scripts/ab_pages.py), a 16-token verify pass ~4% (0.93-1.02) and a batched 16-row step 3-6%; products alone
(scripts/pages_harness.c) ~11% at one input row and ~5% at 16.

Anywhere that does not apply (not Linux, no THP, DFLASH_HUGE_PAGES=0) these are torch.empty / torch.zeros.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading

import torch

HUGE_PAGE = 2 << 20
ARENA = 64 << 20  # weight tiles are packed into arenas this large, so that small ones share huge pages too
ALIGN = 64  # each tensor in an arena starts on a cache line

# Read once at import; scripts that compare both kinds of memory in one process flip it between allocations.
enabled = os.environ.get("DFLASH_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")
_arena: list = []  # [mapping, first free byte] of the arena being filled
_lock = threading.Lock()


def lasting(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor that lives as long as the model (weight tiles), packed with others into a huge-page
    arena. An arena is unmapped only when every tensor in it is gone, so nothing that is freed and re-made often
    belongs here."""
    nbytes = _nbytes(shape, dtype)
    if not enabled:
        return torch.empty(shape, dtype=dtype)
    if nbytes > ARENA // 4:
        return _mapped(shape, dtype)
    with _lock:
        if not _arena or _arena[1] + nbytes > ARENA:
            area, start = _huge_mapping(ARENA)
            _arena[:] = [area, start]
        area, at = _arena
        _arena[1] = at + -(-nbytes // ALIGN) * ALIGN
    return torch.frombuffer(area, dtype=dtype, count=math.prod(shape), offset=at).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of its own mapping, its whole 2 MB pages huge (fresh anonymous memory is zero
    already). For big buffers that are re-made (KV caches grow by copying into a new one)."""
    if not enabled or _nbytes(shape, dtype) < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    return _mapped(shape, dtype)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    area, start = _huge_mapping(_nbytes(shape, dtype))
    # frombuffer holds a reference to `area`: the mapping lives as long as the tensor (and its views)
    return torch.frombuffer(area, dtype=dtype, count=math.prod(shape), offset=start).view(shape)


def _huge_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh mapping with `nbytes` from a 2 MB boundary on: (the mapping, that boundary's offset in it). Only whole
    2 MB pages are asked to be huge: a huge page for a partial tail would hold mostly nothing."""
    # private: a shared anonymous mapping is shmem, whose huge pages follow another setting (usually off)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # + room to align
    view = ctypes.c_char.from_buffer(area)
    start = -ctypes.addressof(view) % HUGE_PAGE
    del view  # a live export would keep the mapping from ever closing
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole:
        try:
            area.madvise(mmap.MADV_HUGEPAGE, start, whole)
        except OSError:  # THP compiled out or disabled: the mapping still works on 4 KB pages
            pass
    return area, start


def return_freed_heap() -> None:
    """Hand the memory that the C library's heap holds free back to the system. glibc keeps what loading allocated
    and freed (conversions, copies, oneDNN's timing runs, released weights) in its heap, and the process's resident
    memory counts it: with SmolLM2 after loading the target and `dflash+ngram`'s drafter, malloc_trim gave back 220
    MB of 2133 in float32, 252 of 1276 in bfloat16 and 151 of 1135 in int8 (~20 ms, once; forty-second session).
    Where the C library has no malloc_trim (not glibc), nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
