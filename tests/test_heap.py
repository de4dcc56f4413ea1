"""The engine's memory stays flat under varied shapes: oneDNN's and ideep's shape-keyed
caches are bounded (engine/core/heap.py), measured on glibc's in-use heap in a fresh process,
since both caches read their limit once, at the first oneDNN call."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from engine.core import heap
from engine.kernels.cpu import cpu_features

# The script's bf16 products reach oneDNN (and its shape caches) only where oneDNN runs bf16.
needs_onednn_bf16 = pytest.mark.skipif(
    not cpu_features().onednn_bf16 or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason=f"needs oneDNN bf16 (AVX-512 BW/VL/DQ) and glibc's mallinfo2; this CPU: {cpu_features().summary()}",
)

# bf16 products over 300 new row counts after 120 warm ones; prints the in-use heap growth.
HEAP_GROWTH_SCRIPT = """
import ctypes, torch, torch.nn.functional as F
from engine.core.heap import limit_onednn_caches

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
limit_onednn_caches()  # what LLMEngine does first
weight = torch.randn(768, 768, dtype=torch.bfloat16)
def run(rows):
    for m in rows:
        F.linear(torch.randn(m, 768, dtype=torch.bfloat16), weight)
run(range(1, 120))
before = libc.mallinfo2().uordblks
run(range(120, 420))
print((libc.mallinfo2().uordblks - before) / 2**20)
"""


def heap_growth_mb(env: dict[str, str]) -> float:
    result = subprocess.run([sys.executable, "-c", HEAP_GROWTH_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in heap.SHAPE_CACHE_ENV}


@needs_onednn_bf16
def test_matmuls_of_many_new_shapes_leave_the_heap_flat() -> None:
    assert heap_growth_mb(clean_env()) < 4  # ~60 MB with the default 1024-entry caches


@needs_onednn_bf16
def test_cache_limits_the_user_set_are_kept() -> None:
    user_set = clean_env() | {name: "1024" for name in heap.SHAPE_CACHE_ENV}
    assert heap_growth_mb(user_set) > 20  # the caches grew: the user's 1024 was used


def test_limits_are_set_only_where_the_user_has_not(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    heap.limit_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(heap.SHAPE_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == "8"
