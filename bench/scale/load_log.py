"""Engine replicas that log their load, for the scale-out benchmark (bench/scale/scale_bench.py)
and tests/test_scale_out.py, which check the router's load bound against the logs; the
product's engine deployment logs nothing of the kind.

    import_path: bench.scale.load_log:build_app   (the app of deployments.app, these replicas in it)

With RAYINFER_LOAD_LOG_DIR=<dir> in an engine replica's environment (the application's
`runtime_env: {env_vars: ...}`, or the environment Ray starts with), it appends every change of its open requests, and the work each
asks of it, to <dir>/<replica id>.log; its routing stats also count the requests it took.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import ray
from ray import serve

from deployments.app import make_app
from deployments.replicas.engine_deployment import EngineDeployment
from deployments.routing.cache_shadow import CacheShadow
from deployments.routing.prefix_routing import block_hashes
from engine import GenerationChunk, SamplingParams
from engine.request.lora_request import LoraRequest
from engine.request.scheduling import Scheduling

LOAD_LOG_DIR_ENV = "RAYINFER_LOAD_LOG_DIR"


class LoadEvent(NamedTuple):
    """One change of a replica's open requests, and the shape of the request that made it."""

    time: float  # wall clock
    num_open: int  # open requests after it
    delta: int  # +1 arrived, -1 left
    num_prompt_tokens: int = 0
    # Not among the blocks of the prompts recently sent to this replica (a shadow of its
    # own arrivals, as deployments/routing/cache_shadow.py keeps one per router): what its prefix
    # cache likely missed, as the routers' work model counts it.
    num_uncached_tokens: int = 0
    max_tokens: int = 0


class LoadLog:
    """Every change of a replica's open `generate` calls, appended to <dir>/<replica id>.log
    as LoadEvent lines (wall clock, so the logs of replicas on one machine merge into one
    timeline: bench/scale/load_balance.py)."""

    def __init__(self, directory: Path, replica_id: str, block_size: int, num_kv_blocks: int) -> None:
        self.num_open = 0
        self._replica_id, self._block_size, self._num_kv_blocks = replica_id, block_size, num_kv_blocks
        self._shapes: dict[str, tuple[int, int, int]] = {}  # open request id -> its shape
        self._shadow = CacheShadow()
        self._file = open(directory / f"{replica_id}.log", "a", buffering=1)

    def arrived(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.num_open += 1
        hashes = block_hashes(prompt_token_ids, self._block_size)
        num_cached = self._shadow.num_cached_blocks(self._replica_id, hashes) * self._block_size
        self._shadow.record(self._replica_id, hashes, self._num_kv_blocks)
        shape = (len(prompt_token_ids), len(prompt_token_ids) - num_cached, max_tokens)
        self._shapes[request_id] = shape
        self._write(1, shape)

    def left(self, request_id: str) -> None:
        self.num_open -= 1
        self._write(-1, self._shapes.pop(request_id, (0, 0, 0)))

    def _write(self, delta: int, shape: tuple[int, int, int]) -> None:
        self._file.write(f"{time.time():.6f} {self.num_open} {delta} {' '.join(map(str, shape))}\n")


def read_load_logs(directory: Path, since: float = 0.0,
                   replica_ids: Collection[str] | None = None) -> dict[str, list[LoadEvent]]:
    """Every replica's LoadLog in directory (or only replica_ids': a redeployed app leaves
    its old replicas' logs, which would count as idle replicas), the events at or after
    `since` (time.time())."""
    logs = {}
    for path in sorted(directory.glob("*.log")):
        if replica_ids is not None and path.stem not in replica_ids:
            continue
        events = [LoadEvent(float(t), *map(int, rest)) for t, *rest in (line.split() for line in path.read_text().splitlines())]
        logs[path.stem] = [event for event in events if event.time >= since]
    return logs


class LoggedEngine(EngineDeployment.func_or_class):
    """The engine deployment, its load logged where LOAD_LOG_DIR_ENV names a directory."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._num_requests = 0
        directory = os.environ.get(LOAD_LOG_DIR_ENV)
        replica_id = serve.get_replica_context().replica_id.unique_id
        stats = self._engine.stats()
        self._load_log = LoadLog(Path(directory), replica_id, self._engine.config.block_size,
                                 stats.num_kv_blocks_total) if directory else None

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       scheduling: Scheduling = Scheduling(),
                       lora: LoraRequest | None = None) -> AsyncIterator[GenerationChunk]:
        self._num_requests += 1
        if self._load_log is not None:
            self._load_log.arrived(request_id, prompt_token_ids, params.max_tokens)
        try:
            async for chunk in super().generate(request_id, prompt_token_ids, params, scheduling, lora):
                yield chunk
        finally:
            if self._load_log is not None:
                self._load_log.left(request_id)

    async def record_routing_stats(self) -> dict:
        return {**await super().record_routing_stats(), "num_requests": self._num_requests}


@dataclass(frozen=True)
class ReplicaCounts:
    """One engine replica's totals since it started (LoggedEngine.record_routing_stats)."""

    num_requests: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int

    def minus(self, other: ReplicaCounts) -> ReplicaCounts:
        return ReplicaCounts(self.num_requests - other.num_requests,
                             self.num_prefix_queried_tokens - other.num_prefix_queried_tokens,
                             self.num_prefix_hit_tokens - other.num_prefix_hit_tokens)


def engine_replica_counts(app: str = "rayinfer") -> dict[str, ReplicaCounts]:
    """Every running engine replica's counts, asked of the replica actors directly (this
    process must be a driver on the app's cluster)."""
    actors = engine_replica_actors(app)
    stats = ray.get([actor.record_routing_stats.remote() for actor in actors.values()])
    return {replica_id: ReplicaCounts(s["num_requests"], s["num_prefix_queried_tokens"], s["num_prefix_hit_tokens"])
            for replica_id, s in zip(actors, stats)}


def engine_replica_actors(app: str = "rayinfer") -> dict[str, ray.actor.ActorHandle]:
    prefix = f"SERVE_REPLICA::{app}#EngineDeployment#"
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if actor["namespace"] == "serve" and actor["name"].startswith(prefix)]
    return {name.removeprefix(prefix): ray.get_actor(name, namespace="serve") for name in names}


def build_app(args: dict) -> serve.Application:
    return make_app(args, engine_class=LoggedEngine)


def make_logged_app(args: dict, deployment_options: dict[str, dict] | None = None) -> serve.Application:
    return make_app(args, deployment_options, engine_class=LoggedEngine)
