"""What the routes call the engine through: a handle to the engine deployment."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ray.serve.handle import DeploymentHandle

from deployments.api.engine_replicas import EngineReplicas
from deployments.api.handles import over_grpc
from engine import EngineStats, GenerationChunk, ModelInfo, SamplingParams
from engine.request.lora_request import LoraRequest
from engine.request.scheduling import Scheduling

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


class EngineClient:
    """The engine deployment, over a handle (Serve's router picks the replica)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = over_grpc(handle)
        self._replicas = EngineReplicas(self._handle)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 scheduling: Scheduling, lora: LoraRequest | None = None) -> EngineStream:
        # By keyword: the prefix router reads prompt_token_ids, params and lora by name (deployments/routing/router.py).
        return self._handle.options(stream=True).generate.remote(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, scheduling=scheduling,
            lora=lora)

    async def load_lora(self, lora: LoraRequest) -> dict:
        """One engine replica reads the adapter now; an InvalidRequestError names what it refuses."""
        return await self.while_up(self._handle.load_lora.remote(lora))

    async def status(self) -> EngineStatus:
        return await self.while_up(self._handle.status.remote())

    async def model_info(self) -> ModelInfo:
        """The engine's model, once a replica is up; the first call also checks this Ray's
        Serve has what the replica watch reads (engine_replicas.py)."""
        info = await self._handle.model_info.remote()
        self._replicas.check_serve_internals()
        return info

    async def while_up(self, waiting: Awaitable[T]) -> T:
        """`waiting`'s result, or a 503 (ApiError) as soon as no engine replica is up to
        serve it: a call waiting on a dead engine fails fast instead of hanging."""
        return await self._replicas.while_up(waiting)
