"""oneDNN's linear on a prepacked weight (`mkldnn._linear_pointwise`, with the epilogues a
GPT-2 block fuses into it: "none", "gelu", "add" of a residual), as an opaque op the decode
graph calls as an extern kernel.

Why: inductor lowers `mkldnn._linear_pointwise` itself, and in bf16 the lowering asserts on a
prepacked weight that is a graph input rather than a constant it packed (LoweringException:
AssertionError), so a decode graph on oneDNN's linears would fall back to eager. Through a custom
op inductor only calls it; the weights stay the graph's inputs, which keeps the graph in
inductor's disk cache. Eager steps call oneDNN directly: the custom op's Python dispatch costs
a few microseconds a call, and a step makes ~50.
"""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, epilogue: str = "none",
           other: torch.Tensor | None = None) -> torch.Tensor:
    """epilogue(x @ weight.T + bias) on oneDNN; opaque to a graph being compiled."""
    if torch.compiler.is_compiling():
        return onednn_linear(x, packed_weight, bias, epilogue, other)
    return _onednn(x, packed_weight, bias, epilogue, other)


def _onednn(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
            other: torch.Tensor | None) -> torch.Tensor:
    if epilogue == "add":
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed_weight, bias, "add")
    if epilogue == "gelu":
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "gelu", [], "tanh")
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@torch.library.custom_op("rayinfer::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
                  other: torch.Tensor | None) -> torch.Tensor:
    return _onednn(x, packed_weight, bias, epilogue, other)


@onednn_linear.register_fake
def _output(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
            other: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))
