"""Linear layers with their weights prepacked for oneDNN, on CPU.

bf16: `F.linear` reorders the weight into oneDNN's blocked layout on every call; packing
once at load gives bit-identical products, cheaper. This is the op PyTorch's own inductor
emits for frozen CPU linears. oneDNN runs bf16 only on AVX-512 BW/VL/DQ or newer.

fp32: `F.linear` runs MKL's sgemm, which is not faster than oneDNN's prepacked fp32 kernels
at the row counts a step runs (BENCHMARKS.md), on AVX2 as on AVX-512. The two round
differently, so fp32 packing is not bit-identical: `linears: reference` keeps F.linear,
the path that is token-exact with Hugging Face.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cpu import cpu_features


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs bf16 only on AVX-512 BW/VL/DQ or newer and raises elsewhere: ask the probe."""
    return device.type == "cpu" and cpu_features().can_pack(dtype)


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias for 2-D x, with the weight in oneDNN's layout.

    The packed weight is an opaque tensor, kept out of the state dict: pack after loading.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Buffers (not in the state dict), so that torch.compile sees them as the module's
        # fixed-shape constants rather than dynamic-shape inputs.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` by a PackedLinear, in place; frees the originals."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)
