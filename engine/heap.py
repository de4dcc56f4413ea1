"""Handing freed heap memory back to the OS once the engine goes idle.

Requests of varied lengths make tensors of varied sizes, and glibc's malloc keeps the
pages of freed ones resident: fragmentation, not a leak. Measured on the engine replica
over ~3,000 varied requests: RSS 2.6 -> 4.4 GB, then flat, with Python's object counts
constant. `malloc_trim(0)` gives every free page back (madvise). Forcing big blocks onto
mmap instead (MALLOC_MMAP_THRESHOLD_=1 MiB) halved decode throughput through page
faults, so the trim runs off the hot path: once, when the step loop has been idle a while.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)


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
