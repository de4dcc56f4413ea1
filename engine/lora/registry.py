"""Which adapters the engine knows, which are resident in a slot, and who is using them.

An adapter is known once add() has read and checked it (its weights kept on the CPU); it is
resident while it holds one of the max_loras slots (engine/lora/slots.py). A running sequence
pins its adapter's slot: acquire() when the scheduler admits it, release() when it finishes,
is aborted or is preempted, the mirror image. A slot is taken free if one is, else from the
least recently acquired adapter no running sequence pins; with every slot pinned the
sequence waits (the scheduler defers it, can_acquire). Slot 0 is the base model's.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import GPT2Config

from engine.lora.adapter import LoraAdapter, LoraAdapterError, load_adapter
from engine.lora.slots import LoraSlots

if TYPE_CHECKING:
    from engine.core.sequence import Sequence


@dataclass(frozen=True)
class LoraInfo:
    """What list_loras() tells the serving layer of one adapter (vLLM's /v1/models lists it
    with the base model as its parent)."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    is_resident: bool


@dataclass(frozen=True)
class LoraStats:
    """Counters since start, for metrics: adapters known and resident, slot loads (each an
    adapter written into a slot), the seconds spent reading adapters (add) and writing slots,
    evictions, and per adapter its requests, prompt tokens and generated tokens."""

    num_adapters: int
    num_resident: int
    num_loads: int
    load_s: float
    num_evictions: int
    requests: dict[str, int] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    generated_tokens: dict[str, int] = field(default_factory=dict)


class LoraRegistry:
    def __init__(self, model: GPT2Config, max_rank: int, slots: LoraSlots):
        self.model, self.max_rank, self.slots = model, max_rank, slots
        self.adapters: dict[str, LoraAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently acquired first
        self.pins: Counter[str] = Counter()  # running sequences per adapter
        self.free_slots = list(range(slots.num_slots - 1, 0, -1))  # popped from the end: slot 1 first
        self.num_loads = self.num_evictions = 0
        self.load_s = 0.0
        self.requests: Counter[str] = Counter()
        self.prompt_tokens: Counter[str] = Counter()
        self.generated_tokens: Counter[str] = Counter()

    def add(self, name: str, path: str | Path) -> LoraInfo:
        """Read and check the adapter; raises LoraAdapterError (a ValueError) naming what it refuses."""
        if name in self.adapters:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded; remove it first")
        started = time.perf_counter()
        self.adapters[name] = load_adapter(name, path, self.model, self.max_rank)
        self.load_s += time.perf_counter() - started
        return self.info(name)

    def remove(self, name: str) -> bool:
        """Forget the adapter and free its slot; False if it is unknown. The caller checks that
        no live request names it."""
        if name not in self.adapters:
            return False
        assert not self.pins[name], "a running sequence still uses this adapter"
        if name in self.resident:
            self._evict(name)
        del self.adapters[name]
        return True

    def info(self, name: str) -> LoraInfo:
        adapter = self.adapters[name]
        return LoraInfo(name, adapter.path, adapter.rank, adapter.scaling, adapter.target_modules,
                        name in self.resident)

    def can_acquire(self, name: str) -> bool:
        return name in self.resident or bool(self.free_slots) or self._victim() is not None

    def acquire(self, seq: Sequence) -> bool:
        """Pin seq's adapter in a slot (loading it, evicting another, where it must) and set
        seq.lora_slot; False, nothing changed, when every slot is pinned."""
        name = seq.lora_name
        if name is None:
            return True
        if name not in self.resident and not self._load(name):
            return False
        self.resident.move_to_end(name)
        self.pins[name] += 1
        seq.lora_slot = self.resident[name]
        return True

    def release(self, seq: Sequence) -> None:
        if seq.lora_name is None or seq.lora_slot == 0:
            return
        self.pins[seq.lora_name] -= 1
        assert self.pins[seq.lora_name] >= 0
        seq.lora_slot = 0

    def record(self, name: str, num_prompt_tokens: int = 0, num_generated_tokens: int = 0,
               is_request: bool = False) -> None:
        self.requests[name] += is_request
        self.prompt_tokens[name] += num_prompt_tokens
        self.generated_tokens[name] += num_generated_tokens

    def stats(self) -> LoraStats:
        return LoraStats(len(self.adapters), len(self.resident), self.num_loads, self.load_s, self.num_evictions,
                         dict(self.requests), dict(self.prompt_tokens), dict(self.generated_tokens))

    def check_integrity(self, running: list[Sequence]) -> None:
        """Pins match the running sequences' adapters; free + resident slots are every slot."""
        expected = Counter(s.lora_name for s in running if s.lora_name is not None)
        assert +self.pins == expected, f"LoRA pins {dict(+self.pins)} != running {dict(expected)}"
        for seq in running:
            assert seq.lora_name is None or seq.lora_slot == self.resident[seq.lora_name]
        assert sorted(self.free_slots + list(self.resident.values())) == list(range(1, self.slots.num_slots))

    def _load(self, name: str) -> bool:
        if not self.free_slots:
            victim = self._victim()
            if victim is None:
                return False
            self._evict(victim)
            self.num_evictions += 1
        started = time.perf_counter()
        slot = self.free_slots.pop()
        self.slots.write(slot, self.adapters[name])
        self.resident[name] = slot
        self.num_loads += 1
        self.load_s += time.perf_counter() - started
        return True

    def _victim(self) -> str | None:
        """The least recently acquired resident adapter no running sequence uses."""
        return next((name for name in self.resident if not self.pins[name]), None)

    def _evict(self, name: str) -> None:
        slot = self.resident.pop(name)
        self.slots.clear(slot)
        self.free_slots.append(slot)
