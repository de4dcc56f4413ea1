"""The resident adapters' weights, stacked per module kind in slots of a fixed shape.

    a[kind]  [n_layer, in, num_slots, max_rank]    slot s's A (x @ A) in a[..., s, :rank]
    b[kind]  [n_layer, num_slots, max_rank, out]   slot s's B, scaling folded in, in b[:, s, :rank]

Slot 0 is all zeros: the base model's rows. An adapter of lower rank is zero-padded and an
adapter that does not target a kind has zeros there, so every step computes the same shapes
and the compiled decode graph, which takes these tensors as inputs, never recompiles for a
new adapter: loading one writes its slot in place.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config

from engine.lora.adapter import MODULE_KINDS, LoraAdapter, module_shape


class LoraSlots:
    def __init__(self, model: GPT2Config, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.num_slots, self.max_rank = max_loras + 1, max_rank
        self.kernel = False  # whether steps run the rows' updates on our C++ op (engine/lora/lora_linear.py)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for kind in MODULE_KINDS:
            fan_in, fan_out = module_shape(model, kind)
            self.a[kind] = torch.zeros(model.n_layer, fan_in, self.num_slots, max_rank, dtype=dtype, device=device)
            self.b[kind] = torch.zeros(model.n_layer, self.num_slots, max_rank, fan_out, dtype=dtype, device=device)

    @property
    def stacks(self) -> tuple[torch.Tensor, ...]:
        """a, b of each kind in MODULE_KINDS order: what a step's LoraBatch takes."""
        return tuple(t for kind in MODULE_KINDS for t in (self.a[kind], self.b[kind]))

    @torch.no_grad()
    def write(self, slot: int, adapter: LoraAdapter) -> None:
        assert 0 < slot < self.num_slots and adapter.rank <= self.max_rank
        self.clear(slot)
        for (layer, kind), (a, b) in adapter.weights.items():
            self.a[kind][layer, :, slot, :adapter.rank].copy_(a)
            self.b[kind][layer, slot, :adapter.rank].copy_(b)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        assert slot > 0, "slot 0 is the base model's, always zero"
        for kind in MODULE_KINDS:
            self.a[kind][:, :, slot].zero_()
            self.b[kind][:, slot].zero_()
