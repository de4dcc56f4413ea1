"""Engine deployment: one replica holds one AsyncEngine (model, paged KV cache, step loop).

`generate` streams the engine's GenerationChunks over a Ray streaming response. When the
caller cancels (client disconnect, stop string matched in the ingress), Serve raises
CancelledError inside `generate`; closing the engine's iterator aborts the request, and
its KV blocks are free by the end of the next step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from engine import AsyncEngine, EngineConfig, EngineStats, GenerationChunk, ModelInfo, SamplingParams


@dataclass(frozen=True)
class EngineStatus:
    model: ModelInfo
    stats: EngineStats
    num_active_requests: int
    is_dead: bool


@serve.deployment(
    ray_actor_options={"num_cpus": 0.5},  # build_app adds num_gpus: 1 where the cluster has GPUs
    max_ongoing_requests=256,  # continuous batching wants every stream in the engine at once
    graceful_shutdown_timeout_s=30,
    health_check_period_s=5,
    logging_config={"enable_access_log": False},
)
class EngineDeployment:
    def __init__(self, config: EngineConfig) -> None:
        route_logs_to_serve("engine")
        self._engine = AsyncEngine(config)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Every token ready since the last chunk; the last chunk has a finish_reason.

        Raises ValueError before the first chunk for a request that can never run.
        """
        async with contextlib.aclosing(self._engine.generate(request_id, prompt_token_ids, params)) as chunks:
            async for chunk in chunks:
                yield chunk

    def model_info(self) -> ModelInfo:
        return self._engine.model_info

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def status(self) -> EngineStatus:
        return EngineStatus(self._engine.model_info, self._engine.stats(),
                            self._engine.num_active_requests(), self._engine.is_dead)

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the step loop has died."""
        self._engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()


def route_logs_to_serve(name: str) -> None:
    """Send a library logger's records through this replica's Serve logger (its file, the
    driver's console), like the replica's own logs; without this INFO records are lost."""
    serve_logger = logging.getLogger("ray.serve")
    logger = logging.getLogger(name)
    logger.handlers = list(serve_logger.handlers)
    logger.setLevel(logging.INFO)
    logger.propagate = False
