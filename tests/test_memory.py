"""Host buffers on huge pages (models/memory.py): what they hold, how long they live, and what the kernel is asked."""

import gc
import mmap
import re
from pathlib import Path

import pytest
import torch

from dflash.models import memory, native
from dflash.models.cache import KVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vma_flags(t: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping that holds t's first byte (/proc/self/smaps)."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError("no mapping holds the tensor")


needs_thp = pytest.mark.skipif(not (memory.enabled and THP.exists() and "[never]" not in THP.read_text()),
                               reason="transparent huge pages are off here")


@pytest.fixture
def huge_pages_on(monkeypatch):
    monkeypatch.setattr(memory, "enabled", hasattr(mmap, "MADV_HUGEPAGE"))


def test_zeros_are_zero_writable_and_aligned(huge_pages_on):
    t = memory.zeros((3, 1024, 1024), torch.float32)  # 12 MB: its own mapping
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and not t.any()
    t[1, 2, 3] = 5.0
    assert t.sum().item() == 5.0
    if memory.enabled:
        assert t.data_ptr() % memory.HUGE_PAGE == 0


def test_small_zeros_stay_torch_tensors(huge_pages_on):
    t = memory.zeros((16, 16), torch.bfloat16)
    assert not t.any() and t.dtype == torch.bfloat16


@needs_thp
def test_whole_huge_pages_are_asked_for(huge_pages_on):
    t = memory.zeros((5 << 20,), torch.uint8)  # 5 MB: two whole 2 MB pages, then a 4 KB tail
    assert "hg" in vma_flags(t)
    tail = t[4 << 20:]
    assert "hg" not in vma_flags(tail)  # a huge page for the 1 MB tail would be half empty


def test_lasting_tensors_share_an_arena_and_outlive_each_other(huge_pages_on):
    a = memory.lasting((1000, 24), torch.float32)
    b = memory.lasting((7, 5), torch.bfloat16)
    a.fill_(1.0), b.fill_(2.0)
    if memory.enabled:
        assert b.data_ptr() - a.data_ptr() == -(-a.numel() * 4 // memory.ALIGN) * memory.ALIGN  # packed, aligned
    del a
    gc.collect()
    c = memory.lasting((300,), torch.float32).fill_(3.0)
    assert b.float().sum().item() == 70.0 and c.sum().item() == 900.0  # no slot was handed out twice


def test_off_means_plain_torch(monkeypatch):
    monkeypatch.setattr(memory, "enabled", False)
    t = memory.lasting((4 << 20,), torch.float32)
    assert t.untyped_storage().nbytes() == 16 << 20  # torch's own allocation, nothing around it
    assert not memory.zeros((4 << 20,), torch.float32).any()


def test_tiles_and_a_growing_cache_keep_their_values(huge_pages_on):
    w = torch.randn(100, 70)
    tiles = native.tiles(w)
    padded = torch.nn.functional.pad(w, (0, 2, 0, 20))  # 120 rows x 72 columns
    assert torch.equal(tiles, padded.view(5, 24, 72).transpose(1, 2))
    cache = KVCache(4, 2, 64, batch=2, capacity=256)  # 1 MB: torch's; grows onto a huge-page mapping
    k = torch.randn(2, 2, 200, 64)
    cache.reserve(200)
    cache.write(3, k, -k)
    cache.advance(200)
    cache.reserve(3000)
    assert cache.capacity >= 3000 and torch.equal(cache.keys[3, :, :, :200], k)
    assert torch.equal(cache.values[3, :, :, :200], -k) and not cache.keys[:, :, :, 200:].any()
