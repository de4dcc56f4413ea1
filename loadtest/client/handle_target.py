"""A running app's engine deployment as a benchmark target: the workload sent over a
Serve handle from this process, which joins the app's Ray cluster. Ray's transport and the
engine replica are in the path; the proxy, the ingress, the tokenizer deployment and HTTP
are not. Run beside the HTTP and offline targets, it splits the gap between them:

    python -m loadtest.bench ... --handle-app rayinfer --offline-model gpt2
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve

from deployments.api.handles import over_grpc
from engine import GenerationChunk, SamplingParams
from loadtest.client.engine_streams import measure
from loadtest.client.results import BenchResult
from loadtest.client.workload import Workload


@dataclass(frozen=True)
class HandleTarget:
    app: str = "rayinfer"
    deployment: str = "EngineDeployment"
    label: str = "engine over a Serve handle"


def run_over_handle(target: HandleTarget, workload: Workload) -> BenchResult:
    """Joins the running cluster (`ray.init(address="auto")`) unless this process already
    is a driver, and leaves it again afterwards."""
    joined = not ray.is_initialized()
    if joined:
        ray.init(address="auto", log_to_driver=False)
    try:
        return asyncio.run(_measure(target, workload))
    finally:
        if joined:
            ray.shutdown()


async def _measure(target: HandleTarget, workload: Workload) -> BenchResult:
    # The ingress's own transport (gRPC between replicas), so the figure is the path it takes.
    handle = over_grpc(serve.get_deployment_handle(target.deployment, app_name=target.app))
    info = await handle.model_info.remote()
    streams = handle.options(stream=True)

    async def generate(request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        response = streams.generate.remote(request_id=request_id, prompt_token_ids=prompt_ids, params=params)
        is_done = False
        try:
            async for chunk in response:
                is_done = chunk.finish_reason is not None
                yield chunk
        finally:
            if not is_done:
                response.cancel()  # the engine aborts the request, as for a disconnect

    where = f"serve handle {target.app}/{target.deployment}"
    return await measure(generate, info.name, target.label, workload, where)
