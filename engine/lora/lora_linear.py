"""One step's LoRA updates: each row's x @ A @ B from its own adapter's slot, all rows at once.

Punica's BGMV gathers each row's A and B and runs a batched product; on the CPU that gather
copies the weights once per row, which cost more than the base linears themselves at 32 rows of
GPT-2-small. Here the shrink runs against every slot in one product (x @ [A_0 .. A_S], K = in,
N = slots * rank), a one-hot row mask keeps each row's own slot, and the expand is one product
against every slot's B (K = slots * rank): two dense GEMMs, no gather, no per-adapter loop, and
no data-dependent shapes, so it compiles into the decode graph as it is. The other slots'
columns add exact zeros. Its cost grows with max_loras * max_rank, not with the adapters a
step uses (docs/lora.md has the measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.lora.adapter import MODULE_KINDS
from engine.model.packed_linear import PackedLinear


@dataclass(frozen=True)
class LayerLora:
    """One layer's slice of a step's LoraBatch."""

    mask: torch.Tensor  # [T, num_slots, 1]: one-hot of each row's slot, in the model's dtype
    a: dict[str, torch.Tensor]  # kind -> [in, num_slots, max_rank]
    b: dict[str, torch.Tensor]  # kind -> [num_slots, max_rank, out]

    def delta(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """[T, out]: each row's scaled low-rank update of linear `kind` on x [T, in]."""
        a, b = self.a[kind], self.b[kind]
        shrunk = (x @ a.flatten(1)).view(x.shape[0], *a.shape[1:]) * self.mask
        return shrunk.flatten(1) @ b.flatten(0, 1)


@dataclass(frozen=True)
class LoraBatch:
    """A step's rows' slots (0: the base model) and the stacked slot weights (LoraSlots.stacks)."""

    mask: torch.Tensor
    stacks: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, slots: torch.Tensor, stacks: tuple[torch.Tensor, ...]) -> LoraBatch:
        num_slots = stacks[0].shape[2]
        mask = slots.unsqueeze(1) == torch.arange(num_slots, device=slots.device)
        return cls(mask.to(stacks[0].dtype).unsqueeze(2), stacks)

    def layer(self, index: int) -> LayerLora:
        a = {kind: self.stacks[2 * i][index] for i, kind in enumerate(MODULE_KINDS)}
        b = {kind: self.stacks[2 * i + 1][index] for i, kind in enumerate(MODULE_KINDS)}
        return LayerLora(self.mask, a, b)


def lora_linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """residual + (layer(x) + delta), as PEFT and HF's block add them; our few-rows op adds
    residual + delta in its epilogue."""
    if isinstance(layer, PackedLinear) and layer.few_rows:
        return layer.with_epilogue(x, "add", residual + delta)
    return residual + (layer(x) + delta)
