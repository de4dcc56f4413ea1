"""The LoRA adapters one engine replica has read: each on the first request that names it
(or a runtime load route), from the directory the Ingress resolved inside `lora_dir`.

The Ingress owns which names exist (deployments/api/lora_catalog.py); a replica only
follows, so adding an engine replica needs no broadcast: the new one reads an adapter when a
request for it first lands there.

Memory: a replica keeps at most `max_cpu_loras` adapters read (EngineConfig.num_cpu_loras).
Reading one past it forgets the least recently requested one that no request of this replica
uses, from its arrival to its end (`use`), so an adapter is never forgotten between the read
and the engine admitting its request, nor while it runs or waits. Where every adapter held
is in use, the replica holds more until requests end: the end of a use past the bound
forgets the idle ones down to it (a task of its own: a request's end never waits on it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Literal

from engine.request.invalid_request import InvalidRequestError
from engine.request.outputs import EngineDeadError
from engine.request.lora_request import LoraRequest

if TYPE_CHECKING:
    from engine import AsyncEngine
    from engine.lora.registry import LoraInfo

# Where a request's adapter was when the request reached the replica: in an engine slot,
# read but not in a slot (a slot write to come), or not read at all (a read from disk).
Holding = Literal["resident", "read", "none"]


class ReplicaAdapters:
    def __init__(self, engine: AsyncEngine, max_adapters: int,
                 on_arrival: Callable[[str, Holding], None] | None = None) -> None:
        self._engine = engine
        self._max_adapters = max_adapters
        self._on_arrival = on_arrival
        self._read_as: OrderedDict[str, LoraRequest] = OrderedDict()  # name -> the load read, least recently requested first
        self._uses: Counter[str] = Counter()  # this replica's requests of each adapter, from arrival to end
        self._read_lock = asyncio.Lock()  # one read or forget at a time: the bound counts every read
        self._trim: asyncio.Task | None = None  # forgetting down to the bound after a use ended past it
        self.num_forgotten = 0

    @contextlib.asynccontextmanager
    async def use(self, lora: LoraRequest | None) -> AsyncIterator[LoraInfo | None]:
        """The adapter (None: the base model), read first where this replica does not hold
        it, and never forgotten until the block ends, however it ends."""
        if lora is None:
            yield None
            return
        self._uses[lora.name] += 1
        try:
            yield await self._ensure(lora)
        finally:
            self._uses[lora.name] -= 1
            if not self._uses[lora.name]:
                del self._uses[lora.name]
            if len(self._read_as) > self._max_adapters and self._trim is None:
                self._trim = asyncio.get_running_loop().create_task(self._trim_to_bound())

    async def _ensure(self, lora: LoraRequest) -> LoraInfo:
        """Raises InvalidRequestError, naming the model field, for an adapter the engine
        refuses (DoRA, a rank past max_lora_rank, another model's shapes)."""
        was_read = self._read_as.get(lora.name) == lora
        if not was_read:
            async with self._read_lock:
                if self._read_as.get(lora.name) != lora:  # else another request read it meanwhile
                    await self._read(lora)
                    await self._forget_past_bound()
        self._read_as.move_to_end(lora.name)
        info = next(info for info in await self._engine.list_loras() if info.name == lora.name)
        if self._on_arrival is not None:
            self._on_arrival(lora.name, "none" if not was_read else "resident" if info.is_resident else "read")
        return info

    async def trimmed(self) -> None:
        """Once a forgetting started by a use's end is done (tests wait on it)."""
        if self._trim is not None:
            await asyncio.shield(self._trim)

    async def _trim_to_bound(self) -> None:
        try:
            async with self._read_lock:
                await self._forget_past_bound()
        except EngineDeadError:  # the replica is going: nothing left to bound
            pass
        finally:
            self._trim = None

    def held(self) -> list[str]:
        """The adapters read, least recently requested first."""
        return list(self._read_as)

    async def _read(self, lora: LoraRequest) -> None:
        try:
            if lora.name in self._read_as:  # the name loaded again since: another directory, or rewritten files
                await self._engine.remove_lora(lora.name)
                del self._read_as[lora.name]
            await self._engine.add_lora(lora.name, lora.path)
        except ValueError as error:  # LoraAdapterError, LoRA off, or the old adapter still in use
            raise InvalidRequestError(f"LoRA adapter {lora.name!r}: {error}", param="model") from None
        self._read_as[lora.name] = lora

    async def _forget_past_bound(self) -> None:
        """Forget the least recently requested adapters no request uses, down to the bound.
        Each leaves _read_as before the engine forgets it, with no await between the check
        that it is idle and that: a request arriving meanwhile reads it again (behind
        _read_lock) rather than finding it held and then missing."""
        for name in list(self._read_as):  # the one just read is in use: kept
            if len(self._read_as) <= self._max_adapters:
                return
            if self._uses[name]:
                continue
            read_as = self._read_as.pop(name)
            try:
                await self._engine.remove_lora(name)
            except ValueError:  # an aborted request the step loop has not yet dropped: kept, for now
                self._read_as[name] = read_as
                self._read_as.move_to_end(name, last=False)
                continue
            self.num_forgotten += 1
