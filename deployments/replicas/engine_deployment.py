"""Engine deployment: one replica holds one AsyncEngine (model, paged KV cache, step loop).

`generate` streams the engine's GenerationChunks over a Ray streaming response. When the
caller cancels (client disconnect, stop string matched in the ingress), Serve raises
CancelledError inside `generate`; closing the engine's iterator aborts the request, and
its KV blocks are free by the end of the next step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import psutil
from ray import serve

from deployments.routing import chunk_budget
from deployments.routing.chunk_budget import ChunkBudget
from deployments.api.engine_client import EngineStatus
from deployments.routing.engine_load import EngineLoad
from deployments.replicas.engine_adapters import ReplicaAdapters
from deployments.observability.logs import quiet_answered_refusals, route_logs_to_serve
from deployments.observability.metrics import EngineMetricsReporter
from engine import EngineConfig, GenerationChunk, ModelInfo, SamplingParams
from engine.model.progress import progress
from engine.request.lora_request import LoraRequest
from engine.request.scheduling import Scheduling

if TYPE_CHECKING:
    from engine import AsyncEngine


logger = logging.getLogger("ray.serve")  # the replica's log file


@serve.deployment(
    name="EngineDeployment",
    ray_actor_options={"num_cpus": 0.5},  # build_app adds num_gpus: 1 where the cluster has GPUs
    max_ongoing_requests=256,  # continuous batching wants every stream in the engine at once
    max_queued_requests=64,  # past it the ingress's handle raises BackPressureError: a 429
    graceful_shutdown_timeout_s=30,
    health_check_period_s=2,  # how soon Serve notices a dead replica and starts another
    logging_config={"enable_access_log": False},
)
class EngineDeployment:
    def __init__(self, config: EngineConfig, max_chunks_per_s: ChunkBudget = "auto") -> None:
        route_logs_to_serve("engine")
        quiet_answered_refusals()
        chunks_per_s = chunk_budget.resolve(max_chunks_per_s)
        logger.info("streaming at most %s chunks/s across all streams (max_chunks_per_s: %s)", chunks_per_s,
                    max_chunks_per_s)
        # Imported here, not with the module: the app's build imports this file, and needs no torch.
        with progress("importing torch and the engine"):
            from engine import AsyncEngine
        self._engine: AsyncEngine = AsyncEngine(config, max_chunks_per_s=chunks_per_s)
        self._metrics = EngineMetricsReporter(self._engine.stats, self._engine.drain_steps)
        self._adapters = ReplicaAdapters(self._engine)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       scheduling: Scheduling = Scheduling(),
                       lora: LoraRequest | None = None) -> AsyncIterator[GenerationChunk]:
        """Every token ready since the last chunk; the last chunk has a finish_reason.

        Raises InvalidRequestError before the first chunk for a request that can never run
        (an adapter this replica cannot read among them).
        """
        lora_name = None if lora is None else (await self._adapters.ensure(lora)).name
        chunks = self._engine.generate(request_id, prompt_token_ids, params, scheduling, lora_name)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def load_lora(self, lora: LoraRequest) -> dict:
        """Read the adapter now (the runtime load route): its errors reach the caller before
        the Ingress lists it. Other replicas read it on their first request for it. A dict
        (LoraInfo's fields): the Ingress unpickling it imports no engine code."""
        return dataclasses.asdict(await self._adapters.ensure(lora))

    def model_info(self) -> ModelInfo:
        return self._engine.model_info

    def status(self) -> EngineStatus:
        return EngineStatus(self._engine.model_info, self._engine.stats(), self._engine.num_active_requests(),
                            self._engine.is_dead, psutil.Process().memory_info().rss)

    async def record_routing_stats(self) -> dict:
        """For the router (deployments/routing/router.py), polled by Serve; async so it reads the
        engine's streams on the loop that changes them."""
        return EngineLoad.of(self._engine).routing_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """For EngineLoadPolicy (deployments/routing/autoscaling.py), polled by Serve."""
        return EngineLoad.of(self._engine).autoscaling_stats()

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the step loop has died."""
        self._engine.check_health()

    def __del__(self) -> None:
        metrics = getattr(self, "_metrics", None)
        if metrics is not None:
            metrics.stop()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()

