"""The KV pool's memory: zeroed, the shape and dtype asked for, and on Linux advised for
transparent huge pages before its first touch (the kernel then backs it with 2 MB pages
where it has them; a decode step's scattered block reads miss the TLB far less)."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.core import kv_pool


def vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pool_is_zeroed_with_the_shape_asked_for(dtype):
    shape = (2, 2, 3, 40, 16, 64)  # layers, k/v, heads, blocks, block size, head size: ~1-2 MB
    pool = kv_pool.allocate(shape, dtype, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[1, 1, 2, 39] = 1.0  # every element is writable, the last included
    assert pool.sum() == 16 * 64


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_a_pool_of_huge_pages_is_advised_for_them():
    pool = kv_pool.allocate((12, 2, 12, 64, 16, 64), torch.bfloat16, torch.device("cpu"))  # 36 MB
    assert pool.data_ptr() % kv_pool.HUGE_PAGE == 0
    assert "hg" in vma_flags(pool.data_ptr())  # smaps' "huge page advise" flag
    plain = kv_pool.allocate((12, 2, 12, 64, 16, 64), torch.bfloat16, torch.device("cpu"), huge_pages=False)
    assert "hg" not in vma_flags(plain.data_ptr())
