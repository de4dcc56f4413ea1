"""The KV pool's memory: one tensor for every layer's keys and values, backed by transparent
huge pages where the OS allows them.

A decode step reads each sequence's blocks wherever the block manager put them: for GPT-2
small, 12 layers × 2 × 12 heads × a few blocks of 2 KB per sequence, each block on a page of
its own. With 4 KB pages nearly every block read is a TLB miss and a page walk; with 2 MB
pages the blocks of a head share a handful of pages.
Only the pool is advised, not the process (PyTorch's THP_MEM_ALLOC_ENABLE would advise every
allocation of 2 MB or more).

The pool is an anonymous mapping of its own, which the kernel hands out zeroed, page by page
at each page's first touch: zeroing gigabytes up front would hold up the engine's start, so
it is spread over the steps that first use each 2 MB of blocks. Zero
matters: attention reads a block's unwritten slots, masked out, and a NaN there would not
stay masked (0 x NaN). The allocator's memory would be zero only where it maps it afresh.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed tensor of `shape`. On a Linux CPU, where it spans a huge page or more, an
    untouched anonymous mapping, advised for huge pages before its first touch (each fault
    then maps a 2 MB page where the kernel can find one)."""
    nbytes = dtype.itemsize * torch.Size(shape).numel()
    madvise = _madvise()
    if device.type != "cpu" or madvise is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE), dtype=torch.uint8)  # the tensor keeps the map
    offset = -raw.data_ptr() % HUGE_PAGE  # aligned to a huge page: the advice holds for every fault to come
    region = raw[offset : offset + nbytes]
    if huge_pages and madvise(ctypes.c_void_p(region.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE) != 0:
        logger.info("KV pool on 4 KB pages: madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
    return region.view(dtype).view(shape)


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True).madvise if name else None
    except (OSError, AttributeError):
        return None
