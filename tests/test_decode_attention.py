"""Decode attention that reads the paged pools in place gives what the eager
gather-then-matmul path gives, on ragged contexts and scattered blocks: the expression
inductor compiles (the decode graph's `decode_attention: torch`), and our C++ kernel (the
decode graph's `decode_attention: native`), built for the probed ISA (AVX2 in CI's emulated
step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import native, native_attention
from engine.model.attention import AttentionGroup, _attend, decode_attention_with_own
from engine.kernels.cpu import cpu_features

HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 4, 40, 16, 16


def ragged_decode_batch(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=generator).to(dtype)
    v_cache = torch.randn(HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=generator).to(dtype)
    context_lens = torch.tensor([1, 17, 40, 64, 5])
    tables = torch.randperm(BLOCKS, generator=generator)[: 5 * 4].view(5, 4)  # 4 blocks of 16 = 64 keys
    mask = torch.arange(4 * BLOCK_SIZE)[None, :] < context_lens[:, None]
    q = torch.randn(5, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables, mask


def eager_reference(q, k_cache, v_cache, tables, mask) -> torch.Tensor:
    return _attend(q.unsqueeze(1), k_cache, v_cache, AttentionGroup(tables, mask.unsqueeze(1), None, None)).squeeze(1)


def own_token_batch(dtype: torch.dtype):
    """ragged_decode_batch plus each query's own k, v, all three strided views of one qkv
    tensor as the model makes them; context_lens count the cached tokens only."""
    q, k_cache, v_cache, tables, mask = ragged_decode_batch(dtype)
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 3, HEADS, HEAD_DIM, generator=generator).to(dtype)
    qkv[:, 0] = q
    context_lens = mask.sum(-1) - 1  # the last cached token of ragged_decode_batch becomes the own one
    return qkv, k_cache, v_cache, tables, context_lens


def reference_with_own(qkv, k_cache, v_cache, tables, context_lens) -> torch.Tensor:
    """The gathering path after writing each row's k, v to its slot at context_lens (its position),
    each row attending to its table's tokens up to it: a decode's or a prefill chunk's row."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    rows = torch.arange(len(tables))
    blocks = tables[rows, context_lens // BLOCK_SIZE]
    k_cache[:, blocks, context_lens % BLOCK_SIZE] = qkv[:, 1].transpose(0, 1)
    v_cache[:, blocks, context_lens % BLOCK_SIZE] = qkv[:, 2].transpose(0, 1)
    mask = torch.arange(tables.shape[1] * BLOCK_SIZE)[None, :] <= context_lens[:, None]
    return eager_reference(qkv[:, 0], k_cache, v_cache, tables, mask)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_kernel_matches_the_gathering_path(dtype, atol):
    kernel = native_attention.load()
    inputs = own_token_batch(dtype)
    qkv, rest = inputs[0], inputs[1:]
    ours = kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], *rest)
    assert ours.dtype == dtype and ours.shape == (5, HEADS, HEAD_DIM)
    torch.testing.assert_close(ours, reference_with_own(*inputs), atol=atol, rtol=atol)
    # and the expression it replaces agrees on the same inputs
    torch.testing.assert_close(decode_attention_with_own(qkv[:, 0], qkv[:, 1], qkv[:, 2], *rest),
                               reference_with_own(*inputs), atol=atol, rtol=atol)


def chunked_batch(dtype: torch.dtype):
    """A step's rows as the graph gives them: two decodes, then a 5-token prefill chunk after
    20 cached tokens, then a 3-token chunk with nothing cached; each chunk's rows share their
    sequence's block table and name the chunk's first row."""
    generator = torch.Generator().manual_seed(2)
    k_cache = torch.randn(HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=generator).to(dtype)
    v_cache = torch.randn(HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=generator).to(dtype)
    tables = torch.randperm(BLOCKS, generator=generator)[:4 * 4].view(4, 4)
    sequence = torch.tensor([0, 1, 2, 2, 2, 2, 2, 3, 3, 3])  # each row's sequence
    tables = tables[sequence]
    first_rows = torch.tensor([0, 1, 2, 2, 2, 2, 2, 7, 7, 7])
    positions = torch.tensor([9, 33, 20, 21, 22, 23, 24, 0, 1, 2])
    qkv = torch.randn(10, 3, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return qkv, k_cache, v_cache, tables, positions, first_rows


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_chunk_rows_attend_causally_to_their_chunk(dtype, atol):
    """Rows of a prefill chunk, beside decodes: each sees its cached tokens and its chunk's
    rows up to itself, in our kernel and in the expression it stands for."""
    kernel = native_attention.load()
    qkv, k_cache, v_cache, tables, positions, first_rows = chunked_batch(dtype)
    cached = positions - (torch.arange(len(positions)) - first_rows)
    expected = reference_with_own(qkv, k_cache, v_cache, tables, positions)  # each row's k, v at its position
    for attention in (kernel, decode_attention_with_own):
        ours = attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, tables, cached, first_rows)
        torch.testing.assert_close(ours, expected, atol=atol, rtol=atol)
    # every row its own chunk is the decode batch the kernel took before first_rows
    decodes = torch.arange(len(positions))
    torch.testing.assert_close(kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, tables, positions, decodes),
                               kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, tables, positions))


def steps_rows(sequences, head_dim: int, dtype: torch.dtype):
    """A step's rows for sequences given as (cached tokens, rows this step): a decode is one
    row, a prefill chunk more; each on blocks of its own, the chunk's rows naming its first."""
    generator = torch.Generator().manual_seed(3)
    blocks_each = max(cached + rows for cached, rows in sequences) // BLOCK_SIZE + 1
    pools = [torch.randn(HEADS, len(sequences) * blocks_each, BLOCK_SIZE, head_dim, generator=generator).to(dtype)
             for _ in range(2)]
    own_blocks = torch.randperm(len(sequences) * blocks_each, generator=generator).view(len(sequences), blocks_each)
    sequence = torch.cat([torch.full((rows,), i) for i, (_, rows) in enumerate(sequences)])
    starts = torch.tensor([0] + [rows for _, rows in sequences]).cumsum(0)[:-1]
    first_rows = starts[sequence]
    positions = torch.cat([cached + torch.arange(rows) for cached, rows in sequences])
    qkv = torch.randn(len(sequence), 3, HEADS, head_dim, generator=generator).to(dtype)
    return qkv, *pools, own_blocks[sequence], positions, first_rows


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_long_prefill_chunk_attends_as_its_rows_would_alone(dtype, atol, head_dim):
    """Chunks of 16 rows or more take the kernel's tiled path (keys staged once per chunk and
    head, rows in tiles): a 37-row chunk after 21 cached tokens (tiles and key groups cut
    short), a 16-row one from nothing, beside decodes and a short chunk, give each row what
    the per-row reference does."""
    kernel = native_attention.load()
    qkv, k_cache, v_cache, tables, positions, first_rows = steps_rows([(9, 1), (21, 37), (33, 1), (0, 16), (4, 3)],
                                                                       head_dim, dtype)
    cached = positions - (torch.arange(len(positions)) - first_rows)
    expected = reference_with_own(qkv, k_cache, v_cache, tables, positions)
    ours = kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, tables, cached, first_rows)
    torch.testing.assert_close(ours, expected, atol=atol, rtol=atol)


def test_a_chunk_whose_rows_disagree_is_attended_row_by_row():
    """The tiled path stages one block table and cached length per chunk; rows naming one
    chunk but holding different ones (not what the engine sends) are each attended alone."""
    kernel = native_attention.load()
    qkv, k_cache, v_cache, tables, positions, first_rows = steps_rows([(21, 20)], 16, torch.float32)
    cached = positions - (torch.arange(len(positions)) - first_rows)
    cached[-1] -= 5  # the last row sees fewer cached tokens than its chunk's others
    moved = tables.clone()
    moved[3, 1] = tables[3, 0]  # and one row reads another block for positions 16-31
    ours = kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, moved, cached, first_rows)
    expected = decode_attention_with_own(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, moved, cached, first_rows)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_native_kernel_is_built_for_the_probed_isa():
    """CI's emulated step (RAYINFER_CPU_ISA=avx2 on an AVX-512 machine) loads and runs the
    AVX2 kernel: the library follows the probe, not the compiler's view of the CPU."""
    expected = "avx512" if cpu_features().avx512 else "avx2" if cpu_features().avx2 else "baseline"
    assert native.isa_build() == expected
    native_attention.load()
    # The install's library (_kernels_<isa>_<fingerprint>.so) or the engine's own build's.
    assert any(f"kernels_{expected}" in Path(path).name for path in torch.ops.loaded_libraries)


def test_native_kernel_rejects_what_it_cannot_run():
    kernel = native_attention.load()
    qkv, k_cache, v_cache, tables, lens = own_token_batch(torch.float32)
    with pytest.raises(RuntimeError, match="head_dim"):
        kernel(qkv[:, 0, :, :12], qkv[:, 1, :, :12], qkv[:, 2, :, :12], k_cache[..., :12], v_cache[..., :12], tables, lens)
    with pytest.raises(RuntimeError, match="k_cache is BFloat16, q is Float"):
        kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache.bfloat16(), v_cache, tables, lens)
    with pytest.raises(RuntimeError, match="block id 40 at index 0 is outside"):
        kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, torch.full_like(tables, BLOCKS), lens)
    with pytest.raises(RuntimeError, match="length 65 of row 0 beyond its block table"):
        kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, tables, torch.full_like(lens, 4 * BLOCK_SIZE + 1))
    with pytest.raises(RuntimeError, match="row 1's chunk starts at row 2"):
        kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, tables, lens, torch.tensor([0, 2, 2, 3, 4]))
    with pytest.raises(RuntimeError, match=r"first_rows \[B\]"):
        kernel(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, tables, lens, torch.arange(4))
    assert native_attention.supports(64) and not native_attention.supports(12)
