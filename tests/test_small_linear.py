"""Packed linears take small steps on our kernels (`small_batch_linear`): in bf16 on AVX-512
BF16, 1 to 64 rows on a weight in panels (engine/kernels/csrc/blocked_linear.cpp); in fp32 on the
AVX2 build, the same on fp32 panels (engine/kernels/csrc/blocked_linear_f32.cpp); elsewhere one to
three rows on the plain weight (engine/kernels/csrc/small_linear.cpp); more rows on oneDNN's, with the
epilogues inductor would have fused (GELU, the residual add). The op is checked against float64 products; the engine on it
against the reference path (F.linear) the way vLLM checks kernels against HF: the same greedy
tokens, or where they diverge each side's token within the other's top 5, logprobs close."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import cpu
from engine.model.packed_linear import PackedLinear, can_pack, in_panels, load_few_rows
from tests.engine_helpers import greedy_logprobs, mixed_prompts

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
        not can_pack(torch.device("cpu"), torch.bfloat16),
        reason=f"needs oneDNN bf16 (AVX-512 BW/VL/DQ); this CPU: {cpu.cpu_features().summary()}")),
]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}
TOP_K = 5
LOGPROB_ATOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}  # bf16 keeps 8 mantissa bits

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                reason=f"needs oneDNN's linear ops on x86-64; this CPU: {cpu.cpu_features().summary()}")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_few_rows()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


NO_PANELS = not in_panels(torch.zeros(1, 2, dtype=torch.bfloat16))
NO_F32_PANELS = not in_panels(torch.zeros(1, 2))


def _layer(dtype: torch.dtype, in_features: int, out_features: int, seed: int) -> tuple[PackedLinear, torch.Tensor]:
    """The layer and its plain weight."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    return PackedLinear(weight, bias, few_rows=True), weight


# Rows: 1-3 the plain kernel's; 4 past it (oneDNN's) and, with panels, 7 and 13 (fp32 tiles of
# 4+3 and 5+4+4 rows; a 12-row bf16 tile and a row), 64 and 65 (past the panels' kernels).
# Shapes (in, out): 100 inputs end inside a vector, 37 outputs inside a panel; 63 inputs
# can't be paired, so stay plain in bf16.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13, 64, 65])
@pytest.mark.parametrize("shape", [(64, 96), (100, 37), (63, 40)])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "add"])
def test_products_and_epilogues_match_float64(dtype, rows, shape, epilogue):
    layer, weight = _layer(dtype, *shape, seed=rows)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(rows, shape[0], generator=generator).to(dtype)
    residual = torch.randn(rows, shape[1], generator=generator).to(dtype) if epilogue == "add" else None
    exact = F.linear(x.double(), weight.double(), layer.bias.double())
    want = {"none": exact, "gelu": F.gelu(exact, approximate="tanh"),
            "add": exact + (residual.double() if residual is not None else 0)}[epilogue]
    got = torch.ops.rayinfer.linear(x, layer.packed_weight, layer.weight, layer.bias, epilogue, residual)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.skipif(NO_PANELS, reason=f"panels need AVX-512 BF16; this CPU: {cpu.cpu_features().summary()}")
def test_bf16_weights_go_in_panels_where_the_cpu_has_bf16_dot_products():
    layer, weight = _layer(torch.bfloat16, 100, 37, seed=0)
    assert in_panels(weight) and layer.weight.shape == (2, 50, 32, 2)  # 37 features padded to 64
    assert layer.weight[1, 3, 4].tolist() == weight[36, 6:8].tolist() and not layer.weight[1, :, 5:].any()
    assert not in_panels(weight.float()) and not in_panels(weight[:, :63])  # fp32; inputs that don't pair


@pytest.mark.skipif(NO_F32_PANELS, reason=f"fp32 panels are the AVX2 build's; this CPU: {cpu.cpu_features().summary()}")
def test_fp32_weights_go_in_panels_where_the_kernels_are_built_for_avx2():
    layer, weight = _layer(torch.float32, 100, 37, seed=0)
    assert layer.weight.shape == (3, 100, 16)  # 37 features padded to 48, input by input
    assert layer.weight[2, 6, 4].item() == weight[36, 6].item() and not layer.weight[2, :, 5:].any()


def test_an_unknown_epilogue_and_an_other_without_add_are_refused():
    layer, _ = _layer(torch.float32, 64, 96, seed=0)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="unknown epilogue"):
        torch.ops.rayinfer.linear(x, layer.packed_weight, layer.weight, layer.bias, "relu")
    with pytest.raises(RuntimeError, match="other"):
        torch.ops.rayinfer.linear(x, layer.packed_weight, layer.weight, layer.bias, "gelu", torch.zeros(1, 96))
    with pytest.raises(RuntimeError, match="other"):
        torch.ops.rayinfer.linear(x, layer.packed_weight, layer.weight, layer.bias, "add")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_engine_takes_it_by_default_and_leaves_it_on_torch(tiny_gpt2_dir, dtype):
    def lm_head(**options) -> PackedLinear:
        return LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=_name(dtype), device="cpu", **options, compile_decode=False).engine.runner.model.lm_head

    assert lm_head().few_rows and lm_head(small_batch_linear="native").few_rows
    assert not lm_head(small_batch_linear="torch").few_rows


def test_native_without_packed_linears_and_unknown_values_are_refused(tiny_gpt2_dir):
    with pytest.raises(ValueError, match="small_batch_linear: native"):
        LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="float32", device="cpu", linears="reference",
            small_batch_linear="native", compile_decode=False)
    with pytest.raises(ValueError, match="small_batch_linear"):
        EngineConfig(model="gpt2", small_batch_linear="fast")


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_stream_on_it_agrees_with_the_reference_path_to_top5_and_logprobs(tiny_gpt2_dir, dtype):
    fast = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=_name(dtype), device="cpu", compile_decode=False)
    reference = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=_name(dtype), device="cpu", linears="reference", compile_decode=False)
    assert fast.engine.runner.model.lm_head.few_rows
    for prompt in mixed_prompts(6):  # one prompt at a time: every decode step is one row
        fast_tokens, fast_lps = greedy_logprobs(fast, prompt, 16)
        ref_tokens, ref_lps = greedy_logprobs(reference, prompt, 16)
        assert fast_tokens[0] == ref_tokens[0]
        for i, (a, b) in enumerate(zip(fast_tokens, ref_tokens)):
            if a != b:  # a near-tie: each side's choice ranks high on the other, then stop
                assert a in ref_lps[i].topk(TOP_K).indices and b in fast_lps[i].topk(TOP_K).indices
                break
            assert abs(fast_lps[i][a] - ref_lps[i][a]) < LOGPROB_ATOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_on_it_agrees_with_the_reference_path_to_top5_and_logprobs(tiny_gpt2_dir, dtype):
    """Twelve prompts at once: steps of 2 to 12 rows, and prefill chunks up to 64 tokens."""
    fast = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=_name(dtype), device="cpu", compile_decode=False)
    reference = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype=_name(dtype), device="cpu", linears="reference", compile_decode=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP_K)
    prompts = mixed_prompts(12)
    for ours, ref in zip(fast.generate(prompts, params), reference.generate(prompts, params)):
        assert ours.token_ids[0] == ref.token_ids[0]
        for a, b in zip(ours.logprobs, ref.logprobs):
            if a.token_id != b.token_id:  # a near-tie, as above
                assert a.token_id in dict(b.top) and b.token_id in dict(a.top)
                break
            assert abs(a.logprob - b.logprob) < LOGPROB_ATOL[dtype]
