"""The HTTP engine (`ingress: engine`): an engine replica that serves the routes itself.

    proxy ──HTTP request──▶ EngineServer (the routes + the engine, one process) ──encode──▶ TokenizerDeployment

The Ingress deployment's routes and the engine deployment's methods in one replica: a
request crosses from Serve's proxy to the process that steps the model, and each chunk
from the engine reaches the routes by reference: more tokens/s and a lower TTFT than the
Ingress deployment's two hops (BENCHMARKS.md, "Designs shipped": routes in the engine replica).
What it gives up: routes that scale apart from the engine, and the prefix-aware router,
which sees the prompts only as the Ingress's handle calls (configs/scale-out.yaml keeps both).
"""

from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.routing.chunk_budget import ChunkBudget
from deployments.api.engine_client import LocalEngine
from deployments.replicas.engine_deployment import ENGINE_OPTIONS, EngineReplica
from deployments.api.routes import api, build_serving
from deployments.replicas.ingress import HTTP_LIMITS
from engine import EngineConfig


@serve.deployment(name="EngineDeployment", **ENGINE_OPTIONS, **HTTP_LIMITS)
@serve.ingress(api)
class EngineServer(EngineReplica):
    async def __init__(self, tokenizer: DeploymentHandle, config: EngineConfig, max_chunks_per_s: ChunkBudget,
                       cpu_bind: str, model_name: str, model: str, api_keys: list[str], max_body_bytes: int,
                       local_encode_max_chars: int, tenant_by_user: bool = False) -> None:
        EngineReplica.__init__(self, config, max_chunks_per_s, cpu_bind)
        self.serving = await build_serving(tokenizer, LocalEngine(self), model_name, model, api_keys, max_body_bytes,
                                           local_encode_max_chars, tenant_by_user)

    async def __del__(self) -> None:
        """Serve's shutdown: the engine's, then the ASGI app's (the next `__del__` in the
        MRO of the class Serve builds around this one)."""
        self.stop_engine()
        await super(EngineReplica, self).__del__()
