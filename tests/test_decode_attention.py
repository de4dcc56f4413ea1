"""Decode attention compiled to read the paged pools in place (`compile_attention: true`)
gives what the eager gather-then-matmul path gives, on ragged contexts and scattered blocks,
and an engine using it generates what the reference engine does."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.attention import AttentionGroup, _attend, compiled_decode_attention, decode_attention
from tests.engine_helpers import greedy_logprobs, mixed_prompts

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


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_matches_the_gathering_path(dtype, atol):
    inputs = ragged_decode_batch(dtype)
    torch.testing.assert_close(decode_attention(*inputs), eager_reference(*inputs), atol=atol, rtol=atol)


@torch.inference_mode()
def test_compiled_decode_attention_matches_the_gathering_path():
    """Under CI's AVX2-emulated step this runs after the AVX-512 step compiled the same
    graph: the kernels must be keyed by vector width (engine/inductor.py), or this reads NaN."""
    inputs = ragged_decode_batch(torch.float32)
    torch.testing.assert_close(compiled_decode_attention()(*inputs), eager_reference(*inputs), atol=1e-5, rtol=1e-5)


def test_engine_with_compiled_attention_agrees_with_reference(tiny_gpt2_dir):
    compiled = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu",
                   linears="reference", compile_attention=True)
    reference = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference")
    assert compiled.engine.runner.fused_decode
    for prompt in mixed_prompts(4):
        tokens, logprobs = greedy_logprobs(compiled, prompt, 12)
        ref_tokens, ref_logprobs = greedy_logprobs(reference, prompt, 12)
        assert tokens == ref_tokens
        for i, token in enumerate(tokens):
            assert abs(logprobs[i][token] - ref_logprobs[i][token]) < 1e-3
