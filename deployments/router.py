"""PrefixAffinityRouter: Serve's request router for the engine deployment.

Set in a config file (configs/scale-out.yaml) on the EngineDeployment entry:

    request_router_config:
      request_router_class: deployments.router:PrefixAffinityRouter
      request_router_kwargs: {load_bound_eps: 0.5, key_blocks: 4}
      request_routing_stats_period_s: 1

Each handle (each ingress replica) has its own router instance; they agree without talking
to each other because the choice is a pure function of the prompt's block hashes and the
replicas' loads (deployments/prefix_routing.py). Routing never waits on anything: the load
comes from what this process already holds: Serve's queue-length cache (every replica
reports its ongoing requests with each response), this router's own requests from the
moment it chose their replica, and, where the cache has nothing fresh, the replicas'
routing stats (polled by Serve every request_routing_stats_period_s).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.metrics import RouterMetrics
from deployments.prefix_routing import Choice, choose, prefix_key

logger = logging.getLogger("ray.serve")

_ENGINE_BLOCK_SIZE = 16  # EngineConfig's default, until a replica reports its own
# A request counts on its chosen replica from the moment it is chosen, before Serve sends it
# (several can be chosen before the first is sent). One cancelled between its choice and its
# send never comes back to on_request_routed or on_request_completed: it stops counting after
# this long unconfirmed.
_UNROUTED_TTL_S = 10.0


@dataclass
class _Placement:
    replica_id: str  # the chosen replica, then the one Serve sent it to
    choice: Choice
    chosen_at: float
    is_routed: bool = False


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, load_bound_eps: float = 0.25, key_blocks: int = 4) -> None:
        if not load_bound_eps >= 0:
            raise ValueError(f"load_bound_eps must be >= 0, got {load_bound_eps!r}")
        if not (isinstance(key_blocks, int) and key_blocks >= 1):
            raise ValueError(f"key_blocks must be a positive integer, got {key_blocks!r}")
        self._eps = load_bound_eps
        self._key_blocks = key_blocks
        self._placements: dict[str, _Placement] = {}  # internal request id -> where it went
        self._metrics = RouterMetrics()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """First rank: the chosen replica. Second: the rest, for when it refuses (full)."""
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        choice = choose(self._key(pending_request, candidate_replicas), self._loads(candidate_replicas), self._eps)
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            self._placements[request_id] = _Placement(choice.replica_id, choice, time.monotonic())
        chosen = by_id.pop(choice.replica_id)
        return [[chosen], list(by_id.values())] if by_id else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        placement = self._placements.get(pending_request.metadata.internal_request_id)
        # Refused by its choice and sent to another: that is a spill too.
        is_choice = placement is not None and placement.choice.replica_id == replica_id.unique_id
        self._metrics.record_routed(replica_id.unique_id, placement.choice.decision if is_choice else "spill")
        if placement is not None:
            placement.replica_id, placement.is_routed = replica_id.unique_id, True

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._placements.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this when the replica set or a replica's routing stats change."""
        super().update_replicas(replicas)
        self._metrics.record_replicas({r.replica_id.unique_id: r.routing_stats or {} for r in replicas})

    def _key(self, pending_request: PendingRequest | None, replicas: list[RunningReplica]) -> int | None:
        token_ids = _prompt_token_ids(pending_request)
        if token_ids is None:
            return None
        return prefix_key(token_ids, _block_size(replicas), self._key_blocks)

    def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        own = self._own_loads()
        return {r.replica_id.unique_id: self._load(r, own.get(r.replica_id.unique_id, 0)) for r in replicas}

    def _own_loads(self) -> dict[str, int]:
        """This router's requests in each replica: chosen or sent, not completed."""
        expired_before = time.monotonic() - _UNROUTED_TTL_S
        for request_id, placement in list(self._placements.items()):
            if not placement.is_routed and placement.chosen_at < expired_before:
                del self._placements[request_id]
        return Counter(placement.replica_id for placement in self._placements.values())

    def _load(self, replica: RunningReplica, num_own: int) -> int:
        """Serve's cache holds the count the replica sent with its last response (every
        router's requests), plus this router's sends and completions since; this router's
        own count is exact for its requests, including those chosen but not yet sent. The
        replica's own report is up to a stats period old: it stands in only where the
        cache has nothing."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is None:
            queue_len = (replica.routing_stats or {}).get("num_active", 0)
        return max(queue_len, num_own)


def _prompt_token_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt of an ingress -> engine `generate(request_id, prompt_token_ids, params)`."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    args = pending_request.args
    token_ids = args[1] if len(args) > 1 else pending_request.kwargs.get("prompt_token_ids")
    return token_ids if isinstance(token_ids, list) else None


def _block_size(replicas: list[RunningReplica]) -> int:
    for replica in replicas:
        block_size = (replica.routing_stats or {}).get("block_size")
        if block_size:
            return block_size
    return _ENGINE_BLOCK_SIZE
