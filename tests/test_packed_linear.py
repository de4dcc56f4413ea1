"""Linears on CPU run on oneDNN-prepacked weights (`linears: auto`) where the CPU probe says
oneDNN runs the dtype. bf16 (AVX-512 BW/VL/DQ or newer): the same bits as F.linear.
Elsewhere bf16 falls back to F.linear, never a crash. fp32 (any x86-64): not bit-identical
to F.linear, so it is checked against the reference path the way vLLM checks kernels
against HF: the same greedy tokens, or where they diverge each side's token within the
other's top 5, with logprobs close. `linears: reference` (F.linear) is never packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.core import llm_engine
from engine.kernels import cpu
from engine.model.packed_linear import PackedLinear, can_pack
from tests.engine_helpers import greedy_logprobs, mixed_prompts

needs_bf16_packing = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16),
    reason=f"needs oneDNN bf16 (AVX-512 BW/VL/DQ); this CPU: {cpu.cpu_features().summary()}",
)
needs_fp32_packing = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32),
    reason=f"needs oneDNN's linear ops on x86-64; this CPU: {cpu.cpu_features().summary()}",
)
TOP_K = 5
LOGPROB_ATOL = 1e-3  # fp32 kernels that sum in a different order


@pytest.fixture
def avx2_only(monkeypatch):
    """The probe capped at AVX2, as on a CPU without AVX-512."""
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    cpu.cpu_features.cache_clear()
    yield
    monkeypatch.delenv(cpu.ISA_ENV)
    cpu.cpu_features.cache_clear()


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_linear_is_bit_identical_to_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 48, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, 48, generator=generator).bfloat16()
    assert torch.equal(PackedLinear(weight, bias)(x), F.linear(x, weight, bias))


@needs_bf16_packing
def test_bf16_engine_packs(tiny_gpt2_dir):
    bf16 = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu", compile_decode=False).engine.runner.model
    assert isinstance(bf16.lm_head, PackedLinear) and isinstance(bf16.h[0].mlp_fc, PackedLinear)


def test_reference_engine_does_not_pack(tiny_gpt2_dir):
    for dtype in ("float32", "bfloat16"):
        model = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=dtype, device="cpu", linears="reference", compile_decode=False).engine.runner.model
        assert model.lm_head is None and isinstance(model.h[0].mlp_fc, torch.nn.Linear)


def test_bf16_engine_without_avx512_falls_back_to_f_linear(tiny_gpt2_dir, avx2_only):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu", compile_decode=False)
    model = llm.engine.runner.model
    assert model.lm_head is None and isinstance(model.h[0].mlp_fc, torch.nn.Linear)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@needs_bf16_packing
def test_packed_bf16_engine_generates_the_same_tokens_as_unpacked(tiny_gpt2_dir, monkeypatch):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = mixed_prompts(8)
    # Packing alone: our kernel for one or two rows rounds differently (tests/test_small_linear.py).
    packed = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu",
                 small_batch_linear="torch", compile_decode=False).generate(prompts, params)
    monkeypatch.setattr(llm_engine, "can_pack", lambda device, dtype: False)
    unpacked_llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu", compile_decode=False)
    assert unpacked_llm.engine.runner.model.lm_head is None
    unpacked = unpacked_llm.generate(prompts, params)
    assert [o.token_ids for o in packed] == [o.token_ids for o in unpacked]


@needs_fp32_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 513])
def test_packed_fp32_linear_is_close_to_f_linear(rows):
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 48, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(rows, 48, generator=generator)
    torch.testing.assert_close(PackedLinear(weight, bias)(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_fp32_packing
def test_fp32_engine_packs_on_auto(tiny_gpt2_dir):
    model = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False).engine.runner.model
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.h[0].attn_qkv, PackedLinear)


@needs_fp32_packing
def test_packed_fp32_engine_agrees_with_reference_to_top5_and_logprobs(tiny_gpt2_dir):
    fast = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    reference = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference", compile_decode=False)
    for prompt in mixed_prompts(8):
        fast_tokens, fast_lps = greedy_logprobs(fast, prompt, 16)
        ref_tokens, ref_lps = greedy_logprobs(reference, prompt, 16)
        for i, (a, b) in enumerate(zip(fast_tokens, ref_tokens)):
            if a != b:  # a near-tie: each side's choice ranks high on the other, then stop
                assert a in ref_lps[i].topk(TOP_K).indices and b in fast_lps[i].topk(TOP_K).indices
                break
            assert abs(fast_lps[i][a] - ref_lps[i][a]) < LOGPROB_ATOL


@needs_fp32_packing
def test_packed_fp32_engine_batched_matches_its_own_single_runs(tiny_gpt2_dir):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", compile_decode=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = mixed_prompts(8)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert batched == [greedy_logprobs(llm, p, 16)[0] for p in prompts]
