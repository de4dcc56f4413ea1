"""Linear layers with their weights prepacked for oneDNN, for bf16 on CPU.

`F.linear` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout on every
call. Packing once at load makes the same products bit-identical and cheaper (GPT-2-small
on 2 AVX-512 BF16 cores: the 48 block linears of a 32-row decode step 12.3 -> 9.3 ms, the
LM head 5.2 -> 3.7 ms). This is the op PyTorch's own inductor emits for frozen CPU linears.

fp32 stays on `F.linear`: MKL's sgemm and oneDNN round differently, and fp32 is the path
that must be token-exact with Hugging Face.
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
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

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
