"""Engine deployment: one replica holds one AsyncEngine (model, paged KV cache, step loop).

`generate` streams the engine's GenerationChunks over a Ray streaming response. When the
caller cancels (client disconnect, stop string matched in the ingress), Serve raises
CancelledError inside `generate`; closing the engine's iterator aborts the request, and
its KV blocks are free by the end of the next step.
"""

from __future__ import annotations

import asyncio
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
from deployments.observability.metrics import EngineMetricsReporter, LoraMetrics
from engine import EngineConfig, GenerationChunk, ModelInfo, SamplingParams
from engine.request.outputs import EngineDeadError
from engine.model.progress import progress
from engine.request.lora_request import LoraRequest
from engine.request.scheduling import Scheduling

if TYPE_CHECKING:
    from engine import AsyncEngine
    from engine.lora.registry import LoraStats


logger = logging.getLogger("ray.serve")  # the replica's log file
_LORA_SAMPLE_TIMEOUT_S = 5.0  # a step of a long prefill, with room


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
        lora_metrics = LoraMetrics() if config.max_loras else None
        self._metrics = EngineMetricsReporter(self._engine.stats, self._engine.drain_steps,
                                              None if lora_metrics is None else self._sample_lora, lora_metrics)
        self._adapters = ReplicaAdapters(self._engine, config.num_cpu_loras,
                                         None if lora_metrics is None else lora_metrics.record_arrival)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       scheduling: Scheduling = Scheduling(),
                       lora: LoraRequest | None = None) -> AsyncIterator[GenerationChunk]:
        """Every token ready since the last chunk; the last chunk has a finish_reason.

        Raises InvalidRequestError before the first chunk for a request that can never run
        (an adapter this replica cannot read among them).
        """
        async with self._adapters.use(lora) as adapter:  # held from here to the request's end
            chunks = self._engine.generate(request_id, prompt_token_ids, params, scheduling,
                                           None if adapter is None else adapter.name)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk

    async def load_lora(self, lora: LoraRequest) -> dict:
        """Read the adapter now (the runtime load route): its errors reach the caller before
        the Ingress lists it. Other replicas read it on their first request for it. A dict
        (LoraInfo's fields): the Ingress unpickling it imports no engine code."""
        async with self._adapters.use(lora) as adapter:
            return dataclasses.asdict(adapter)

    def model_info(self) -> ModelInfo:
        return self._engine.model_info

    def status(self) -> EngineStatus:
        return EngineStatus(self._engine.model_info, self._engine.stats(), self._engine.num_active_requests(),
                            self._engine.is_dead, psutil.Process().memory_info().rss)

    async def record_routing_stats(self) -> dict:
        """For the router (deployments/routing/router.py), polled by Serve; async so it reads the
        engine's streams on the loop that changes them. With LoRA on, the adapters in the
        engine's slots too (a step loop round trip): the router sends an adapter's requests
        where it is resident."""
        load = EngineLoad.of(self._engine)
        if not self._engine.config.max_loras:
            return load.routing_stats()
        resident = [info.name for info in await self._engine.list_loras() if info.is_resident]
        return load.routing_stats() | {"lora_resident": resident, "max_loras": self._engine.config.max_loras}

    def _sample_lora(self) -> LoraStats | None:
        """The engine's LoRA counters, from the metrics thread (its own event loop, a step
        loop round trip); None where the engine does not answer."""
        try:
            return asyncio.run(asyncio.wait_for(self._engine.lora_stats(), _LORA_SAMPLE_TIMEOUT_S))
        except (EngineDeadError, TimeoutError):
            return None

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

