"""Our C++ decode attention (engine/csrc/decode_attention.cpp), built for this CPU's vector
ISA the first time an engine asks for it and loaded as the op `torch.ops.rayinfer.decode_attention`.

Why a kernel of our own: inductor's code for the same expression (engine/attention.py
decode_attention_with_own) reduces every key's dot product across vector lanes inside
several barriers, and runs at half the pools' memory bandwidth on this model's decode step
(BENCHMARKS.md, "A decode attention of our own"). The kernel reads each sequence's blocks
in place, like vLLM's CPU paged attention.

The build needs a C++ compiler and ninja (torch.utils.cpp_extension), as inductor needs the
compiler; it is cached under ~/.cache/torch_extensions, keyed by the source and flags, so
only a process that finds no build compiles (~10 s). The ISA comes from the CPU probe, so
RAYINFER_CPU_ISA=avx2 builds (and runs) the AVX2 kernel on an AVX-512 machine too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from engine.cpu import cpu_features

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"

# The macro selects ATen's vector types (at::vec) for the ISA; the flags let the compiler emit it.
_ISA_FLAGS = {
    "avx512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "avx2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "baseline": [],
}

DecodeAttention = Callable[..., torch.Tensor]


# The kernel walks a head in whole float vectors: 16 lanes on AVX-512, 8 on AVX2.
HEAD_DIM_MULTIPLE = 16


def supports(head_dim: int) -> bool:
    return head_dim % HEAD_DIM_MULTIPLE == 0 and head_dim <= 512


def isa_build() -> str:
    """Which of _ISA_FLAGS this CPU's kernel is built for: the probe's vector width, the one
    inductor's kernels are tiled for too (engine/inductor.py)."""
    return {512: "avx512", 256: "avx2"}.get(cpu_features().vector_bits, "baseline")


@functools.cache
def load() -> DecodeAttention:
    """torch.ops.rayinfer.decode_attention, built or loaded once per process; raises where it
    cannot be built (no compiler, no ninja)."""
    from torch.utils import cpp_extension

    isa = isa_build()
    cpp_extension.load(name=f"rayinfer_decode_attention_{isa}", sources=[str(SOURCE)],
                       extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS[isa]], is_python_module=False)
    torch.library.register_fake("rayinfer::decode_attention")(_output_like_query)
    logger.info("decode attention: our C++ kernel, built for %s", isa)
    return torch.ops.rayinfer.decode_attention


def _output_like_query(q: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)
