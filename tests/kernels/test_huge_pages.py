"""Tensors on transparent huge pages (batchgen_kernels.huge_pages): the values and layout of
their plain counterparts, 2 MiB-aligned memory advised MADV_HUGEPAGE where the system allows it,
plain memory when turned off or small, and a mapping that lives exactly as long as its tensor."""
from __future__ import annotations

import gc

import pytest
import torch

from batchgen_kernels import huge_pages
from batchgen_kernels.expert_tiles import tile_experts, tiles_supported
from batchgen_kernels.tiled_linear import tile_weight

LARGE = (1024, 2048)  # 8 MiB of fp32
needs_thp = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                               reason="transparent huge pages unavailable here (not Linux, or mode never)")


def smaps_entry(address: int) -> tuple[int, int, dict[str, str]] | None:
    """(start, end, fields) of this process's mapping that holds address, from /proc/self/smaps."""
    found: tuple[int, int, dict[str, str]] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                if found is not None:
                    return found
                start, end = (int(v, 16) for v in head.split("-"))
                found = (start, end, {}) if start <= address < end else None
            elif found is not None:
                name, _, value = line.partition(":")
                found[2][name] = value.strip()
    return found


def mapping_of(address: int) -> tuple[int, int, set[str]] | None:
    """(start, end, VmFlags) of this process's mapping that holds address."""
    entry = smaps_entry(address)
    return None if entry is None else (entry[0], entry[1], set(entry[2]["VmFlags"].split()))


def resident_bytes(address: int) -> int:
    """Rss of this process's mapping that holds address."""
    entry = smaps_entry(address)
    assert entry is not None, f"no mapping holds {address:#x}"
    return int(entry[2]["Rss"].split()[0]) * 1024


def test_zeros_are_zeros_of_the_shape_and_dtype() -> None:
    for shape, dtype in ((LARGE, torch.float32), ((3, 5), torch.float32), ((2, 1024, 1024), torch.bfloat16)):
        t = huge_pages.zeros_on_huge_pages(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
        t.fill_(1)  # writable
        assert t.sum().item() == t.numel()


def test_contiguous_copy_keeps_values_and_owns_its_memory() -> None:
    src = torch.randn(2048, 1024)
    view = src.view(128, 16, 1024).transpose(1, 2)
    out = huge_pages.contiguous_on_huge_pages(view)
    assert out.is_contiguous() and torch.equal(out, view.contiguous())
    src.zero_()
    assert out.abs().sum() > 0  # a copy, not a view of src


@needs_thp
def test_large_buffers_are_aligned_and_advised() -> None:
    t = huge_pages.zeros_on_huge_pages(LARGE, torch.float32)
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    mapping = mapping_of(t.data_ptr())
    assert mapping is not None and "hg" in mapping[2]  # advised MADV_HUGEPAGE


@needs_thp
def test_zeros_are_faulted_in_when_made() -> None:
    # as torch.zeros's are: a first touch (and the compaction it may wait for) belongs to loading,
    # not to the steps that first write the buffer
    t = huge_pages.zeros_on_huge_pages(LARGE, torch.float32)
    assert resident_bytes(t.data_ptr()) >= t.numel() * t.element_size()


@needs_thp
def test_small_buffers_and_the_switch_keep_plain_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    small = huge_pages.zeros_on_huge_pages((256, 256), torch.float32)
    mapping = mapping_of(small.data_ptr())
    assert mapping is None or "hg" not in mapping[2]
    monkeypatch.setenv("BATCHGEN_HUGE_PAGES", "0")
    assert not huge_pages.huge_pages_available()
    off = huge_pages.contiguous_on_huge_pages(torch.randn(LARGE).t())
    mapping = mapping_of(off.data_ptr())
    assert mapping is None or "hg" not in mapping[2]


@needs_thp
def test_the_mapping_lives_as_long_as_its_tensor() -> None:
    t = huge_pages.contiguous_on_huge_pages(torch.arange(2 * 1024 * 1024, dtype=torch.float32).view(2048, 1024))
    view = t[5:7]
    address = t.data_ptr()
    del t
    gc.collect()
    assert mapping_of(address) is not None
    assert view[1, 3].item() == 6 * 1024 + 3  # still readable through the view
    del view
    gc.collect()
    mapping = mapping_of(address)
    assert mapping is None or "hg" not in mapping[2]  # unmapped (the range may be reused, unadvised)


@needs_thp
def test_weight_tiles_are_on_huge_pages() -> None:
    w13, w2, w = torch.randn(2, 2048, 512), torch.randn(2, 512, 1024), torch.randn(1024, 1024)
    assert tiles_supported(w13, w2)
    tiles, dense = tile_experts(w13, w2), tile_weight(w)
    for t in (tiles.w13, tiles.w2, dense.tiles):
        mapping = mapping_of(t.data_ptr())
        assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and mapping is not None and "hg" in mapping[2]
    assert all(torch.equal(a, b) for a, b in zip(tiles.untiled(), (w13, w2)))
    assert torch.equal(dense.untiled(), w)
