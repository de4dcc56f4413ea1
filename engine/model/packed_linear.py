"""Linear layers with their weights prepacked for oneDNN, on CPU.

bf16: `F.linear` reorders the weight into oneDNN's blocked layout on every call; packing
once at load gives bit-identical products, cheaper. This is the op PyTorch's own inductor
emits for frozen CPU linears. oneDNN runs bf16 only on AVX-512 BW/VL/DQ or newer.

fp32: `F.linear` runs MKL's sgemm, which is not faster than oneDNN's prepacked fp32 kernels
at the row counts a step runs, on AVX2 as on AVX-512. The two round differently, so fp32 packing is not bit-identical: `linears:
reference` keeps F.linear, the path that is token-exact with Hugging Face.

The prepack and the prepacked linear are torch's private mkldnn ops (no public API packs
for oneDNN): torch is pinned exactly, and tests/test_torch_internals.py fails on one that moved.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import engine.kernels.native as native
import engine.kernels.onednn_linear as onednn
from engine.kernels.cpu import cpu_features


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs bf16 only on AVX-512 BW/VL/DQ or newer and raises elsewhere: ask the probe."""
    return device.type == "cpu" and cpu_features().can_pack(dtype)


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias for 2-D x, with the weight in oneDNN's layout.

    The packed weight is an opaque tensor, kept out of the state dict: pack after loading.
    With `few_rows`, a second copy of the weight stays beside it for torch.ops.rayinfer.linear
    (engine/kernels/csrc/small_linear.cpp), which runs small steps where oneDNN is slow: in bf16 on
    AVX-512 BF16, the weight in panels (`panels`) and steps of 1 to 64 rows on
    engine/kernels/csrc/blocked_linear.cpp; in fp32 on AVX2, the same on
    engine/kernels/csrc/blocked_linear_f32.cpp; elsewhere, the plain weight and steps of
    one to three rows. `max_rows` caps the rows
    our op takes (more go to oneDNN's): -1, the kernel's own limit, until the tuner
    (engine/core/tuner.py) has measured where the two cross on this CPU; 0, oneDNN's always.
    `brgemm_rows`: steps past max_rows and up to it run oneDNN's brgemm ukernel on the same bf16
    panels (engine/kernels/csrc/brgemm_linear.cpp: AMX tiles where the CPU has them); 0, none.
    Without `few_rows` every step runs oneDNN's product (engine/kernels/onednn_linear.py).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, few_rows: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Buffers (not in the state dict), so that torch.compile sees them as the module's
        # fixed-shape constants rather than dynamic-shape inputs.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        own = (panels(weight) if in_panels(weight) else weight.detach().contiguous()) if few_rows else None
        self.register_buffer("weight", own, persistent=False)
        self.max_rows = -1
        self.brgemm_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_epilogue(x, "none")

    def with_epilogue(self, x: torch.Tensor, epilogue: str, other: torch.Tensor | None = None) -> torch.Tensor:
        """epilogue(x @ weight.T + bias), "none", "gelu" or "add" of other: on our op up to
        max_rows rows where few_rows, else on oneDNN's."""
        if self.few_rows:
            return torch.ops.rayinfer.linear(x, self.packed_weight, self.weight, self.bias, epilogue, other,
                                             self.max_rows, self.brgemm_rows)
        return onednn.linear(x, self.packed_weight, self.bias, epilogue, other)

    @property
    def few_rows(self) -> bool:
        return self.weight is not None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def own_max_rows(layer: PackedLinear) -> int:
    """The most rows our op takes on this layer's weight unless max_rows lowers it: the limits
    engine/kernels/csrc/small_linear.cpp holds (kMaxBlockedRows on panels, plain_rows else)."""
    if layer.weight is None:
        return 0
    if layer.weight.dim() > 2:
        return 64
    return 2 if layer.weight.dtype == torch.float32 and native.isa_build() == "avx512" else 3


def runs_brgemm(layer: PackedLinear) -> bool:
    """Whether oneDNN's brgemm ukernel can take this layer's small steps: its weight in bf16
    panels (oneDNN's VNNI layout), on a CPU where the ukernel runs bf16 (avx512_core or newer:
    the kernels' probe; AVX2 CPUs, or ONEDNN_MAX_CPU_ISA=AVX2, have none)."""
    return (layer.weight is not None and layer.weight.dim() == 4 and layer.weight.dtype == torch.bfloat16
            and torch.ops.rayinfer.brgemm_available())


PANEL = 32  # bf16 output features a panel: engine/kernels/csrc/blocked_linear.cpp's kPanel
F32_PANEL = 16  # fp32 output features a panel on the AVX2 build: two 8-lane vectors (blocked_linear_f32.cpp)


def in_panels(weight: torch.Tensor) -> bool:
    """Whether our kernel takes this weight in panels: bf16 with an even number of inputs (a
    dot product takes them in pairs), on a CPU with AVX-512 BF16 and kernels built for it;
    fp32 where the kernels are built for AVX2 (on AVX-512, oneDNN's fp32 is as fast as ours
    from three rows on)."""
    if weight.dtype == torch.float32:
        return native.isa_build() == "avx2"
    return (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and cpu_features().avx512_bf16
            and native.isa_build() == "avx512")


def panels(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [ceil(N / 32), K / 2, 32, 2]: 32 output features a panel, zero past N, k-pair
    by k-pair, so that one 64-byte load holds 16 features' weights for two inputs. fp32 [N, K]
    -> [ceil(N / 16), K, 16]: input by input, two 32-byte loads a panel's weights for one."""
    out_features, in_features = weight.shape
    if weight.dtype == torch.float32:
        padded = F.pad(weight.detach(), (0, 0, 0, -out_features % F32_PANEL))
        return padded.view(-1, F32_PANEL, in_features).transpose(1, 2).contiguous()
    padded = F.pad(weight.detach(), (0, 0, 0, -out_features % PANEL))
    return padded.view(-1, PANEL, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


@functools.cache
def load_few_rows() -> None:
    """Our op for small steps, with the fake implementation that lets the decode graph
    trace through it; raises where the kernels cannot be built."""
    native.load()
    torch.library.register_fake("rayinfer::linear")(_linear_output)


def _linear_output(x: torch.Tensor, packed_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   epilogue: str = "none", other: torch.Tensor | None = None, max_rows: int = -1,
                   brgemm_rows: int = 0) -> torch.Tensor:
    out_features = weight.shape[0] if weight.dim() == 2 else packed_weight.shape[0]  # panels pad to 32
    return x.new_empty((*x.shape[:-1], out_features))


# A linear and what follows it in a GPT-2 block, as one op where the layer is ours for few
# rows, or packed in the decode graph: the graph cannot see through our op nor the opaque
# oneDNN one, so the epilogue goes in it, as inductor would have fused it. Elsewhere the
# plain expressions, unchanged (the reference path's included): eager, oneDNN's packed
# product alone is bit-identical to F.linear in bf16, and the epilogues stay so too.
def linear_gelu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """gelu(layer(x)), tanh-approximated as GPT-2's."""
    if _fuses(layer):
        return layer.with_epilogue(x, "gelu")
    return F.gelu(layer(x), approximate="tanh")


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x)."""
    if _fuses(layer):
        return layer.with_epilogue(x, "add", residual)
    return residual + layer(x)


def lora_linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """residual + (layer(x) + delta), as PEFT and HF's block add them; our few-rows op adds
    residual + delta in its epilogue."""
    if isinstance(layer, PackedLinear) and layer.few_rows:
        return layer.with_epilogue(x, "add", residual + delta)
    return residual + (layer(x) + delta)


def _fuses(layer: nn.Module) -> bool:
    return isinstance(layer, PackedLinear) and (layer.few_rows or torch.compiler.is_compiling())


def pack_linears(module: nn.Module, few_rows: bool = False) -> None:
    """Replace every nn.Linear under `module` by a PackedLinear, in place; frees the originals
    (keeps their weights with `few_rows`)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias, few_rows))
        else:
            pack_linears(child, few_rows)
