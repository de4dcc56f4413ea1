"""The LoRA adapters one engine replica has read: each on the first request that names it
(or a runtime load route), from the directory the Ingress resolved inside `lora_dir`.

The Ingress owns which names exist (deployments/api/lora_catalog.py); a replica only
follows, so adding an engine replica needs no broadcast: the new one reads an adapter when a
request for it first lands there.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from engine.request.invalid_request import InvalidRequestError
from engine.request.lora_request import LoraRequest

if TYPE_CHECKING:
    from engine import AsyncEngine
    from engine.lora.registry import LoraInfo


class ReplicaAdapters:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._paths: dict[str, str] = {}  # name -> the directory it was read from
        self._locks: dict[str, asyncio.Lock] = {}  # one read per name, however many requests wait on it

    async def ensure(self, lora: LoraRequest) -> LoraInfo:
        """The adapter, read first where this replica does not hold it; an adapter the engine
        refuses (DoRA, a rank past max_lora_rank, another model's shapes) is an
        InvalidRequestError naming the model field."""
        async with self._locks.setdefault(lora.name, asyncio.Lock()):
            if self._paths.get(lora.name) != lora.path:
                await self._read(lora)
        return next(info for info in await self._engine.list_loras() if info.name == lora.name)

    async def _read(self, lora: LoraRequest) -> None:
        try:
            if lora.name in self._paths:  # the name now points at another directory
                await self._engine.remove_lora(lora.name)
                del self._paths[lora.name]
            await self._engine.add_lora(lora.name, lora.path)
        except ValueError as error:  # LoraAdapterError, LoRA off, or the old adapter still in use
            raise InvalidRequestError(f"LoRA adapter {lora.name!r}: {error}", param="model") from None
        self._paths[lora.name] = lora.path
