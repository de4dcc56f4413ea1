"""Small steps on oneDNN's brgemm ukernel (`small_batch_linear: brgemm`, or where `auto`
measures it fastest): the op on the weights' bf16 panels computes what float64 does, with the
epilogues, at 1 to 64 rows and at GPT-2-small's shapes; rows outside its range go to the
other kernels; and the compiled decode graph runs it as it runs eagerly. Skips, with the
reason, where it cannot run: no bf16 panels (no AVX-512 BF16, or the AVX2 build), or an
oneDNN below avx512_core (an AVX2 CPU, or ONEDNN_MAX_CPU_ISA=AVX2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.model.packed_linear import PackedLinear, can_pack, load_few_rows, runs_brgemm
from tests.test_decode_graph import compare

TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-2}  # bf16's, as test_small_linear's


def _layer(in_features: int, out_features: int, seed: int) -> tuple[PackedLinear, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).bfloat16()
    return PackedLinear(weight, torch.randn(out_features, generator=generator).bfloat16(), few_rows=True), weight


def _skip_reason() -> str | None:
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        return "oneDNN does not pack bf16 on this CPU"
    load_few_rows()
    if not runs_brgemm(_layer(64, 32, 0)[0]):
        return "no bf16 panels here, or oneDNN's brgemm ukernel does not run bf16 (it needs avx512_core)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


@pytest.mark.parametrize("rows", [1, 2, 7, 13, 33, 64])
@pytest.mark.parametrize("shape", [(64, 96), (100, 37), (768, 2304), (3072, 768)])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "add"])
def test_products_and_epilogues_match_float64(rows, shape, epilogue):
    layer, weight = _layer(*shape, seed=rows)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(rows, shape[0], generator=generator).bfloat16()
    residual = torch.randn(rows, shape[1], generator=generator).bfloat16() if epilogue == "add" else None
    exact = F.linear(x.double(), weight.double(), layer.bias.double())
    want = {"none": exact, "gelu": F.gelu(exact, approximate="tanh"),
            "add": exact + (residual.double() if residual is not None else 0)}[epilogue]
    got = torch.ops.rayinfer.linear(x, layer.packed_weight, layer.weight, layer.bias, epilogue, residual, 0, 64)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **TOLERANCE)


def test_rows_past_ours_and_up_to_brgemm_rows_run_brgemm_and_the_rest_the_others():
    """brgemm and oneDNN's product round alike (fp32 sums of the same bf16 products) but add in
    another order: the rows each ran on differ from the others' in the last bits."""
    layer, _ = _layer(768, 768, seed=0)
    x = torch.randn(8, 768).bfloat16()

    def run(rows: int, max_rows: int, brgemm_rows: int) -> torch.Tensor:
        return torch.ops.rayinfer.linear(x[:rows], layer.packed_weight, layer.weight, layer.bias, "none", None,
                                         max_rows, brgemm_rows)
    assert torch.equal(run(4, 0, 4), run(4, 0, 64))  # brgemm both
    assert torch.equal(run(4, -1, 64), run(4, -1, 0))  # ours both: within max_rows brgemm_rows is not asked
    assert torch.equal(run(8, 0, 4), run(8, 0, 0))  # oneDNN's both: past brgemm_rows


def test_a_forced_brgemm_sets_every_linear_to_it(tiny_gpt2_dir):
    llm = LLM(str(tiny_gpt2_dir), weights="pretrained", dtype="bfloat16", device="cpu", compile_decode=False,
              small_batch_linear="brgemm")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert layers and {(m.max_rows, m.brgemm_rows) for m in layers} == {(0, 64)}


def test_compiled_decode_on_brgemm_matches_the_eager_path(tiny_gpt2_dir):
    """The op is opaque to the graph as on our kernel: the graph runs it, compiles once, and
    its tokens' scores match the eager engine's."""
    compare(tiny_gpt2_dir, "bfloat16", "auto", atol=0.15, small_batch_linear="brgemm")
