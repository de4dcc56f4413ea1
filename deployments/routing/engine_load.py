"""What an engine replica reports about its load, to the router and to the autoscaler.

Serve polls `record_routing_stats` (for the router, as `replica.routing_stats`) and
`record_autoscaling_stats` (for the autoscaling policy, as `ctx.aggregated_metrics`) on the
engine deployment; both read one EngineLoad. A LoadLog times each change of the replica's
open requests and the work each asks of it, for benchmarks and tests to check the router's
load bound against.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from deployments.routing.cache_shadow import CacheShadow
from deployments.routing.prefix_routing import block_hashes

if TYPE_CHECKING:
    from engine import AsyncEngine


@dataclass(frozen=True)
class EngineLoad:
    num_active: int  # admitted and not finished: what the bounded-load router counts
    reported_at: float  # time.time() when num_active was counted (this report)
    num_waiting: int  # of those, no token yet (queued or prefilling)
    num_waiting_prompt_tokens: int
    kv_cache_usage: float  # 0..1
    block_size: int  # the prefix cache's block: routers key prompts with it
    num_kv_blocks: int  # the pool: as many blocks as a router's shadow of this cache keeps
    num_pending_prompt_tokens: int  # not yet computed, of every live request
    num_pending_decode_tokens: int  # still to decode (up to max_tokens), of every live request
    pending_at: float  # time.time() when the engine counted those two (its last step)
    num_requests: int  # totals since the replica started
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int

    @classmethod
    def of(cls, engine: AsyncEngine, num_requests: int) -> EngineLoad:
        stats, num_active, now = engine.stats(), engine.num_active_requests(), time.time()
        num_waiting, num_waiting_tokens = engine.waiting_work()
        # The pending counts are as of the engine's last step; with no request open they are
        # zero now, and say so: an idle replica's report never ages into "unknown", where a
        # router would fall back on Serve's queue-length cache, which lags completions.
        if num_active:
            pending_prompt, pending_decode, pending_at = (stats.num_pending_prompt_tokens,
                                                          stats.num_pending_decode_tokens, stats.taken_at)
        else:
            pending_prompt, pending_decode, pending_at = 0, 0, now
        return cls(num_active=num_active, reported_at=now, num_waiting=num_waiting,
                   num_waiting_prompt_tokens=num_waiting_tokens, kv_cache_usage=stats.kv_cache_usage,
                   block_size=engine.config.block_size, num_kv_blocks=stats.num_kv_blocks_total,
                   num_pending_prompt_tokens=pending_prompt, num_pending_decode_tokens=pending_decode,
                   pending_at=pending_at,
                   num_requests=num_requests,
                   num_prefix_queried_tokens=stats.num_prefix_queried_tokens,
                   num_prefix_hit_tokens=stats.num_prefix_hit_tokens)

    def routing_stats(self) -> dict:
        return asdict(self)

    def autoscaling_stats(self) -> dict[str, float]:
        """The signals EngineLoadPolicy scales on (deployments/routing/autoscaling.py)."""
        return {"engine_requests": float(self.num_active),
                "engine_waiting_prompt_tokens": float(self.num_waiting_prompt_tokens),
                "engine_kv_cache_usage": self.kv_cache_usage}



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


LOAD_LOG_DIR_ENV = "RAYINFER_LOAD_LOG_DIR"  # set by benchmarks and tests, off in service


class LoadLog:
    """Where RAYINFER_LOAD_LOG_DIR is set in the replica's environment, every change of its
    open `generate` calls, appended to <dir>/<replica id>.log as LoadEvent lines (wall
    clock, so the logs of replicas on one machine merge into one timeline:
    loadtest/scale/load_balance.py). Elsewhere it only counts."""

    def __init__(self, replica_id: str, block_size: int, num_kv_blocks: int) -> None:
        self.num_open = 0
        self._replica_id, self._block_size, self._num_kv_blocks = replica_id, block_size, num_kv_blocks
        self._shapes: dict[str, tuple[int, int, int]] = {}  # open request id -> its shape
        self._shadow = CacheShadow()
        directory = os.environ.get(LOAD_LOG_DIR_ENV)
        self._file = open(Path(directory) / f"{replica_id}.log", "a", buffering=1) if directory else None

    def arrived(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.num_open += 1
        if self._file is not None:
            hashes = block_hashes(prompt_token_ids, self._block_size)
            num_cached = self._shadow.num_cached_blocks(self._replica_id, hashes) * self._block_size
            self._shadow.record(self._replica_id, hashes, self._num_kv_blocks)
            shape = (len(prompt_token_ids), len(prompt_token_ids) - num_cached, max_tokens)
            self._shapes[request_id] = shape
            self._write(1, shape)

    def left(self, request_id: str) -> None:
        self.num_open -= 1
        if self._file is not None:
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
