"""PrefixAffinityRouter: Serve's request router for the engine deployment.

Set in a config file (configs/scale-out.yaml) on the EngineDeployment entry:

    request_router_config:
      request_router_class: deployments.router:PrefixAffinityRouter
      request_router_kwargs: {load_bound_eps: 0.25, key_blocks: 4}
      request_routing_stats_period_s: 1

Each handle (each ingress replica) has its own router instance; they agree without talking
to each other because the choice is a pure function of the prompt's block hashes and the
replicas' loads (deployments/prefix_routing.py). Routing never waits on anything: the load
comes from what this process already holds: Serve's queue-length cache (every replica
reports its ongoing requests with each response), this router's own requests in flight,
and, where the cache has nothing fresh, the replicas' routing stats (polled by Serve every
request_routing_stats_period_s).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.metrics import RouterMetrics
from deployments.prefix_routing import Choice, choose, prefix_key

logger = logging.getLogger("ray.serve")

_ENGINE_BLOCK_SIZE = 16  # EngineConfig's default, until a replica reports its own
# Choices made for requests not yet routed: a request cancelled while it waits for a replica
# never comes back for its entry, so only this many of the newest are kept.
_MAX_PENDING_CHOICES = 4096


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, load_bound_eps: float = 0.25, key_blocks: int = 4) -> None:
        if not load_bound_eps >= 0:
            raise ValueError(f"load_bound_eps must be >= 0, got {load_bound_eps!r}")
        if not (isinstance(key_blocks, int) and key_blocks >= 1):
            raise ValueError(f"key_blocks must be a positive integer, got {key_blocks!r}")
        self._eps = load_bound_eps
        self._key_blocks = key_blocks
        self._in_flight: dict[str, ReplicaID] = {}  # internal request id -> its replica
        self._choices: OrderedDict[str, Choice] = OrderedDict()  # made, not yet routed
        self._metrics = RouterMetrics()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """First rank: the chosen replica. Second: the rest, for when it refuses (full)."""
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        choice = choose(self._key(pending_request, candidate_replicas), self._loads(candidate_replicas), self._eps)
        if pending_request is not None:
            self._remember(pending_request.metadata.internal_request_id, choice)
        chosen = by_id.pop(choice.replica_id)
        return [[chosen], list(by_id.values())] if by_id else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._in_flight[request_id] = replica_id
        choice = self._choices.pop(request_id, None)
        # Refused by its choice and sent to another: that is a spill too.
        decision = choice.decision if choice and choice.replica_id == replica_id.unique_id else "spill"
        self._metrics.record_routed(replica_id.unique_id, decision)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.pop(internal_request_id, None)
        self._choices.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this when the replica set or a replica's routing stats change."""
        super().update_replicas(replicas)
        self._metrics.record_replicas({r.replica_id.unique_id: r.routing_stats or {} for r in replicas})

    def _remember(self, request_id: str, choice: Choice) -> None:
        self._choices[request_id] = choice
        self._choices.move_to_end(request_id)
        if len(self._choices) > _MAX_PENDING_CHOICES:
            self._choices.popitem(last=False)

    def _key(self, pending_request: PendingRequest | None, replicas: list[RunningReplica]) -> int | None:
        token_ids = _prompt_token_ids(pending_request)
        if token_ids is None:
            return None
        return prefix_key(token_ids, _block_size(replicas), self._key_blocks)

    def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        in_flight: dict[ReplicaID, int] = {}
        for replica_id in self._in_flight.values():
            in_flight[replica_id] = in_flight.get(replica_id, 0) + 1
        loads = {}
        for replica in replicas:
            loads[replica.replica_id.unique_id] = self._load(replica, in_flight.get(replica.replica_id, 0))
        return loads

    def _load(self, replica: RunningReplica, num_in_flight: int) -> int:
        """Freshest first: Serve's cache holds the count the replica sent with its last
        response, plus this router's sends and completions since. The replica's own report
        is up to a stats period old, so it only stands in when the cache has nothing."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is not None:
            return max(queue_len, num_in_flight)
        return max((replica.routing_stats or {}).get("num_active", 0), num_in_flight)


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
