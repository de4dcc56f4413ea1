"""One step's LoRA updates: each row's x @ A @ B from its own adapter's slot, all rows at once.

Two forms of Punica's BGMV, one per path, each the faster there (bench/micro/lora_bench.py,
docs/lora.md):

    per_row  (the compiled decode graph) gather each row's A and B from the stacked slots and
             run two batched products; inductor fuses the gather into the products, reading each
             row's slot in place, so its cost is the rows', whatever max_loras is.
    dense    (eager steps) the shrink against every slot in one product (x @ [A_0 .. A_S]), a
             one-hot row mask keeping each row's own slot, the expand against every slot's B in
             another: two GEMMs, no gather (eager ATen copies each row's gathered weights,
             dearer than the base linears), no per-adapter loop. The other slots' columns add
             exact zeros.

Neither has data-dependent shapes or a step per adapter; slot 0 (zeros) is the base model's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.adapter import MODULE_KINDS


@dataclass(frozen=True)
class LayerLora:
    """One layer's slice of a step's LoraBatch."""

    slots: torch.Tensor  # [T]: each row's slot
    mask: torch.Tensor | None  # [T, num_slots, 1]: one-hot of each row's slot (dense), None (per_row)
    a: dict[str, torch.Tensor]  # kind -> [in, num_slots, max_rank]
    b: dict[str, torch.Tensor]  # kind -> [num_slots, max_rank, out]

    def delta(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """[T, out]: each row's scaled low-rank update of linear `kind` on x [T, in]."""
        a, b = self.a[kind], self.b[kind]
        if self.mask is None:
            shrunk = torch.bmm(x.unsqueeze(1), a[:, self.slots].transpose(0, 1))
            return torch.bmm(shrunk, b[self.slots]).squeeze(1)
        shrunk = (x @ a.flatten(1)).view(x.shape[0], *a.shape[1:]) * self.mask
        return shrunk.flatten(1) @ b.flatten(0, 1)


@dataclass(frozen=True)
class LoraBatch:
    """A step's rows' slots (0: the base model) and the stacked slot weights (LoraSlots.stacks)."""

    slots: torch.Tensor
    mask: torch.Tensor | None
    stacks: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, slots: torch.Tensor, stacks: tuple[torch.Tensor, ...], per_row: bool = False) -> LoraBatch:
        """per_row: the gathering form, for the compiled graph; else the dense one, for eager steps."""
        if per_row:
            return cls(slots, None, stacks)
        mask = slots.unsqueeze(1) == torch.arange(stacks[0].shape[2], device=slots.device)
        return cls(slots, mask.to(stacks[0].dtype).unsqueeze(2), stacks)

    def layer(self, index: int) -> LayerLora:
        a = {kind: self.stacks[2 * i][index] for i, kind in enumerate(MODULE_KINDS)}
        b = {kind: self.stacks[2 * i + 1][index] for i, kind in enumerate(MODULE_KINDS)}
        return LayerLora(self.slots, self.mask, a, b)
