# The private parts of torch the engine calls, pinned with torch itself (pyproject.toml:
# torch==2.13.0): each test fails on a torch that moved one, so an upgrade is caught here,
# never in service as a fast path that silently fell back or broke.
from __future__ import annotations

import tomllib

import torch

from tests.serve_helpers import ROOT


def test_the_installed_torch_is_the_pinned_one() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [pin] = [d for d in dependencies if d.startswith("torch")]
    assert torch.__version__.split("+")[0] == pin.removeprefix("torch==")


def test_onednn_still_prepacks_a_linear_weight_and_runs_the_prepacked_linear() -> None:
    """engine/model/packed_linear.py and engine/kernels/onednn_linear.py: the prepack op and
    the linear that takes its result."""
    weight, x = torch.randn(64, 32), torch.randn(4, 32)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-4, atol=1e-4)


def test_dynamo_still_marks_a_tensor_static_and_inductor_patches_its_config() -> None:
    """engine/model/decode_graph.py, cuda_graphs.py, engine/core/tuner.py: mark_static on the
    KV pool; engine/kernels/inductor.py: config.patch and the C++ wrapper's class."""
    torch._dynamo.mark_static(torch.zeros(2))
    with torch._inductor.config.patch(freezing=True), torch._dynamo.config.patch(specialize_float=True):
        assert torch._inductor.config.freezing
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    assert CppWrapperCpu
