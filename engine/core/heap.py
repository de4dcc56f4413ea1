"""Keeping the engine's resident memory flat under varied traffic. Resident memory grows for
two reasons, neither a leak:

- Two caches keyed by matmul shape, 1024 entries each by default: oneDNN's compiled
  primitives (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and, in front of it, the LRU of PyTorch's
  ideep wrapper (LRU_CACHE_CAPACITY). Every step's token count and context width is a
  new shape, so both keep growing for thousands of requests. 64 entries keep the
  recurring shapes of a steady batch; far fewer thrash.
- glibc's malloc keeps the pages of freed tensors of varied sizes resident.
  `malloc_trim(0)` gives every free page back (madvise). Forcing big blocks onto mmap
  instead (MALLOC_MMAP_THRESHOLD_) slows decode through page faults, so the trim runs off
  the hot path: once, when the step loop has been idle a while.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

SHAPE_CACHE_CAPACITY = 64
SHAPE_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def limit_onednn_caches() -> None:
    """Both are read once, at the first oneDNN call: call before the model runs. Values
    the user already set are kept."""
    for name in SHAPE_CACHE_ENV:
        os.environ.setdefault(name, str(SHAPE_CACHE_CAPACITY))


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim_heap() -> bool:
    """Return free heap pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
