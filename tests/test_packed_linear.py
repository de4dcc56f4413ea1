"""bf16 linears on CPU run on oneDNN-prepacked weights where oneDNN runs bf16 (AVX-512
BW/VL/DQ or newer): same bits as F.linear, so packing changes speed and nothing else.
Elsewhere bf16 falls back to F.linear, never a crash. fp32, the token-exact reference
path, is never packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams, cpu, llm_engine
from engine.packed_linear import PackedLinear, can_pack
from tests.engine_helpers import mixed_prompts

needs_bf16_packing = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16),
    reason=f"needs oneDNN bf16 (AVX-512 BW/VL/DQ); this CPU: {cpu.cpu_features().summary()}",
)


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
    bf16 = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu").engine.runner.model
    assert isinstance(bf16.lm_head, PackedLinear) and isinstance(bf16.h[0].mlp_fc, PackedLinear)


def test_fp32_engine_does_not_pack(tiny_gpt2_dir):
    fp32 = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu").engine.runner.model
    assert fp32.lm_head is None and isinstance(fp32.h[0].mlp_fc, torch.nn.Linear)


def test_bf16_engine_without_avx512_falls_back_to_f_linear(tiny_gpt2_dir, avx2_only):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu")
    model = llm.engine.runner.model
    assert model.lm_head is None and isinstance(model.h[0].mlp_fc, torch.nn.Linear)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@needs_bf16_packing
def test_packed_bf16_engine_generates_the_same_tokens_as_unpacked(tiny_gpt2_dir, monkeypatch):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = mixed_prompts(8)
    packed = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu").generate(prompts, params)
    monkeypatch.setattr(llm_engine, "can_pack", lambda device, dtype: False)
    unpacked_llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu")
    assert unpacked_llm.engine.runner.model.lm_head is None
    unpacked = unpacked_llm.generate(prompts, params)
    assert [o.token_ids for o in packed] == [o.token_ids for o in unpacked]
