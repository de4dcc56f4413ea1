"""Our C++ decode attention (engine/kernels/csrc/decode_attention.cpp, built by engine/kernels/native.py),
as the op `torch.ops.rayinfer.decode_attention` the decode graph calls: for decodes, and
for the rows of prefill chunks, each attending causally to its chunk's rows before it.

Why a kernel of our own: inductor's code for the same expression (engine/model/attention.py
decode_attention_with_own) reduces every key's dot product across vector lanes inside
several barriers, and falls well short of the pools' memory bandwidth on this model's decode
step. The kernel reads each sequence's blocks
in place, like vLLM's CPU paged attention; a long prefill chunk's rows share their keys, and
it takes them in tiles of rows (engine/kernels/csrc/chunk_attention.h).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import engine.kernels.native as native

DecodeAttention = Callable[..., torch.Tensor]

# The kernel walks a head in whole float vectors: 16 lanes on AVX-512, 8 on AVX2.
HEAD_DIM_MULTIPLE = 16


def supports(head_dim: int) -> bool:
    return head_dim % HEAD_DIM_MULTIPLE == 0 and head_dim <= 512


@functools.cache
def load() -> DecodeAttention:
    """The op, with the fake implementation that lets the compiled graph trace through it;
    raises where the kernels cannot be built."""
    op = native.load().decode_attention
    torch.library.register_fake("rayinfer::decode_attention")(_output_like_query)
    return op


def _output_like_query(q: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)
