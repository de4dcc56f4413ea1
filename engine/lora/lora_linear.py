"""One step's LoRA updates: each row's x @ A @ B from its own adapter's slot, all rows at once.

Three forms of Punica's BGMV (bench/micro/lora_bench.py, docs/lora.md):

    kernel   (CPU, where our C++ kernels load; eager steps and the compiled graph alike) our
             op (engine/kernels/csrc/lora_delta.cpp): rows sorted by slot, each slot's A and B
             read once for all its rows, base rows skipped. The forms below read a slot once
             per row, or multiply by every slot.
    per_row  (the compiled decode graph) gather each row's A and B from the stacked slots and
             run two batched products; inductor fuses the gather into the products, reading each
             row's slot in place, so its cost is the rows', whatever max_loras is.
    dense    (eager steps) the shrink against every slot in one product (x @ [A_0 .. A_S]), a
             one-hot row mask keeping each row's own slot, the expand against every slot's B in
             another: two GEMMs, no gather (eager ATen copies each row's gathered weights,
             dearer than the base linears), no per-adapter loop. The other slots' columns add
             exact zeros.

None has data-dependent shapes or a step per adapter; slot 0 (zeros) is the base model's rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

import engine.kernels.native as native

from engine.lora.adapter import MODULE_KINDS


LoraForm = Literal["kernel", "per_row", "dense"]


@functools.cache
def load_kernel() -> None:
    """Our op, with the fake implementation that lets the decode graph trace through it;
    raises where the kernels cannot be built."""
    native.load()
    torch.library.register_fake("rayinfer::lora_delta")(_delta_output)


def _delta_output(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], b.shape[2])


@dataclass(frozen=True)
class LayerLora:
    """One layer's slice of a step's LoraBatch."""

    form: LoraForm
    slots: torch.Tensor  # [T]: each row's slot
    mask: torch.Tensor | None  # [T, num_slots, 1]: one-hot of each row's slot (dense only)
    a: dict[str, torch.Tensor]  # kind -> [in, num_slots, max_rank]
    b: dict[str, torch.Tensor]  # kind -> [num_slots, max_rank, out]

    def delta(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """[T, out]: each row's scaled low-rank update of linear `kind` on x [T, in]."""
        a, b = self.a[kind], self.b[kind]
        if self.form == "kernel":
            return torch.ops.rayinfer.lora_delta(x, self.slots, a, b)
        if self.form == "per_row":
            shrunk = torch.bmm(x.unsqueeze(1), a[:, self.slots].transpose(0, 1))
            return torch.bmm(shrunk, b[self.slots]).squeeze(1)
        shrunk = (x @ a.flatten(1)).view(x.shape[0], *a.shape[1:]) * self.mask
        return shrunk.flatten(1) @ b.flatten(0, 1)


@dataclass(frozen=True)
class LoraBatch:
    """A step's rows' slots (0: the base model) and the stacked slot weights (LoraSlots.stacks)."""

    form: LoraForm
    slots: torch.Tensor
    mask: torch.Tensor | None
    stacks: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, slots: torch.Tensor, stacks: tuple[torch.Tensor, ...], form: LoraForm) -> LoraBatch:
        if form != "dense":
            return cls(form, slots, None, stacks)
        mask = slots.unsqueeze(1) == torch.arange(stacks[0].shape[2], device=slots.device)
        return cls(form, slots, mask.to(stacks[0].dtype).unsqueeze(2), stacks)

    def layer(self, index: int) -> LayerLora:
        a = {kind: self.stacks[2 * i][index] for i, kind in enumerate(MODULE_KINDS)}
        b = {kind: self.stacks[2 * i + 1][index] for i, kind in enumerate(MODULE_KINDS)}
        return LayerLora(self.form, self.slots, self.mask, a, b)
