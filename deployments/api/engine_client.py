"""What the routes call the engine through: a handle to the engine deployment, or the engine
replica the routes run in (`ingress: engine`, deployments/replicas/engine_server.py).

Both give the same calls. In-process, a chunk is the engine's own object, passed by
reference: no Ray call, no serialization, no second process between the engine and Serve's
proxy (BENCHMARKS.md, "Designs shipped": routes in the engine replica).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from ray.serve.handle import DeploymentHandle

from deployments.api.engine_replicas import EngineReplicas
from deployments.api.handles import over_grpc
from engine import EngineStats, GenerationChunk, ModelInfo, SamplingParams
from engine.request.scheduling import Scheduling

if TYPE_CHECKING:
    from deployments.replicas.engine_deployment import EngineReplica

T = TypeVar("T")


@dataclass(frozen=True)
class EngineStatus:
    """What `status()` reports; defined here, not beside the replica, so that an Ingress
    unpickling it never imports the engine's code (and torch with it)."""

    model: ModelInfo
    stats: EngineStats
    num_active_requests: int
    is_dead: bool
    rss_bytes: int  # of this replica's process: flat over time, or something leaks


class EngineStream(Protocol):
    """A request's chunks; `cancel()` aborts the request in the engine."""

    def __aiter__(self) -> AsyncIterator[GenerationChunk]: ...

    def cancel(self) -> None: ...


class EngineClient(Protocol):
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 scheduling: Scheduling) -> EngineStream: ...

    async def status(self) -> EngineStatus: ...

    async def model_info(self) -> ModelInfo: ...

    async def while_up(self, waiting: Awaitable[T]) -> T:
        """`waiting`'s result, or a 503 (ApiError) as soon as no engine replica is up to
        serve it: a call waiting on a dead engine fails fast instead of hanging."""
        ...


class RemoteEngine:
    """The engine deployment, over a handle (Serve's router picks the replica)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = over_grpc(handle)
        self._replicas = EngineReplicas(self._handle)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 scheduling: Scheduling) -> EngineStream:
        return self._handle.options(stream=True).generate.remote(request_id, prompt_token_ids, params, scheduling)

    async def status(self) -> EngineStatus:
        return await self.while_up(self._handle.status.remote())

    async def model_info(self) -> ModelInfo:
        return await self._handle.model_info.remote()

    async def while_up(self, waiting: Awaitable[T]) -> T:
        return await self._replicas.while_up(waiting)


class LocalEngine:
    """The engine replica this code runs in, called directly on its event loop."""

    def __init__(self, replica: EngineReplica) -> None:
        self._replica = replica
        self._closing: set[asyncio.Task] = set()  # cancelled streams' closes, held until done

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 scheduling: Scheduling) -> EngineStream:
        return _LocalStream(self._replica.generate(request_id, prompt_token_ids, params, scheduling), self._closing)

    async def status(self) -> EngineStatus:
        return self._replica.status()

    async def model_info(self) -> ModelInfo:
        return self._replica.model_info()

    async def while_up(self, waiting: Awaitable[T]) -> T:
        """Always up: a dead replica runs no code, so no one is left here to answer
        (Serve's proxy holds such requests until a new replica is up)."""
        return await waiting


class _LocalStream:
    def __init__(self, chunks: AsyncIterator[GenerationChunk], closing: set[asyncio.Task]) -> None:
        self._chunks, self._closing = chunks, closing

    def __aiter__(self) -> AsyncIterator[GenerationChunk]:
        return self._chunks

    def cancel(self) -> None:
        """Closing the replica's generator aborts the request (its `finally`), as Serve's
        cancel of a remote stream does; a generator already finished closes at once."""
        task = asyncio.get_running_loop().create_task(_close(self._chunks))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


async def _close(chunks: AsyncIterator[GenerationChunk]) -> None:
    with contextlib.suppress(RuntimeError):  # still running in another task: that task ends it
        await chunks.aclose()  # type: ignore[attr-defined]
