"""PrefixAffinityRouter: Serve's request router for the engine deployment.

Set in a config file (configs/scale-out.yaml) on the EngineDeployment entry:

    request_router_config:
      request_router_class: deployments.routing.router:PrefixAffinityRouter
      request_router_kwargs: {load_bound_eps: 0.75, key_blocks: 4}  # load_unit: work, decode_token_cost: 1
      request_routing_stats_period_s: 1

Each handle (each ingress replica) has its own router instance; they agree without talking
to each other because the choice is a pure function of the prompt's block hashes and the
replicas' loads (deployments/routing/prefix_routing.py). Routing never waits on anything: the load
comes from what this process already holds: this router's own requests in each replica,
exactly, from the moment it chose their replica, and the other routers' as of the
replica's last report (record_routing_stats, polled by Serve every
request_routing_stats_period_s: request_load); where a report is stale, Serve's
queue-length cache.

load_unit: requests counts each request as one. work (deployments/routing/prefix_routing.py
choose_by_work) weighs a replica by the work it last reported still ahead of it
(record_routing_stats: prompt tokens not yet computed, plus decode_token_cost per token
still to decode, of every router's requests) plus this router's requests that report
cannot hold (not yet taken by the replica when it reported), each at what it asks of its
replica: the prompt tokens that replica likely lacks (this router's CacheShadow) plus its
decode. Where a replica's report is missing or stale, this router's own requests stand in,
and the rest of Serve's count (other routers') at this request's weight.

A request under a LoRA adapter (the call's `lora`) is keyed by its adapter, not its prefix:
it goes to the adapter's home (deployments/routing/adapter_homes.py: the adapters this router
routed within _ADAPTER_WINDOW_S, placed by bounded-load rendezvous within each replica's
reported `max_loras`, alike in every router), within the same bound; past it, to a replica
holding the adapter in an engine slot (as the replica last reported, `lora_resident`, or as
this router sent it one since), then to one with a free slot. Its prompt's blocks are salted
by the adapter, so prefix affinity holds within an adapter (prefix_routing.py, adapter).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.routing.adapter_homes import assign_homes, recent_adapters
from deployments.routing.cache_shadow import DEFAULT_NUM_BLOCKS, CacheShadow
from deployments.observability.metrics import RouterMetrics
from deployments.routing.prefix_routing import (
    FREE_SLOT, HOLDS, HOME, NO_SLOT, Choice, adapter_key, block_hashes, choose, choose_by_work, request_work,
)
from engine import SamplingParams
from engine.request.lora_request import LoraRequest

logger = logging.getLogger("ray.serve")

LoadUnit = Literal["requests", "work"]
_ENGINE_BLOCK_SIZE = 16  # EngineConfig's default, until a replica reports its own
# A request counts on its chosen replica from the moment it is chosen, before Serve sends it
# (several can be chosen before the first is sent). One cancelled between its choice and its
# send never comes back to on_request_routed or on_request_completed: it stops counting after
# this long unconfirmed.
_UNROUTED_TTL_S = 10.0
# A replica's report (its open requests, its pending work) stands for its load only while
# fresh (Serve polls every request_routing_stats_period_s); older (a replica slow to answer),
# the router counts its own requests and Serve's count instead.
_REPORT_MAX_AGE_S = 5.0
# An adapter keeps a home while this router routed it within this long: long enough that an
# adapter in use keeps its home between requests (a home reassigned moves others' too), short
# enough that one no longer asked for frees its home for the next.
_ADAPTER_WINDOW_S = 120.0


@dataclass
class _Placement:
    replica_id: str  # the chosen replica, then the one Serve sent it to
    choice: Choice
    chosen_at: float  # time.time(): compared with the replicas' reports
    work: float  # what it asks of the chosen replica (load_unit work)
    adapter: str | None = None  # its LoRA adapter
    routed_at: float | None = None  # time.time() when Serve told this router the replica took it
    ended_at: float | None = None  # time.time() when Serve told this router it ended

    @property
    def is_routed(self) -> bool:
        return self.routed_at is not None


@dataclass(frozen=True)
class _Prompt:
    """What the router reads from an ingress -> engine `generate` call."""

    hashes: list[int]  # its full blocks' prefix-cache keys (salted by its adapter's key)
    block_size: int
    num_tokens: int
    max_tokens: int
    adapter: str | None = None  # the LoRA adapter it runs under

    def key(self, key_blocks: int) -> int | None:
        """The adapter's key, else the hash of its first key_blocks blocks (prefix_routing.prefix_key)."""
        if self.adapter is not None:
            return adapter_key(self.adapter)
        return self.hashes[min(key_blocks, len(self.hashes)) - 1] if self.hashes else None


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, load_bound_eps: float = 0.75, key_blocks: int = 4, load_unit: LoadUnit = "requests",
                         decode_token_cost: float = 1.0) -> None:
        _check_kwargs(load_bound_eps, key_blocks, load_unit, decode_token_cost)
        self._eps, self._key_blocks = load_bound_eps, key_blocks
        self._load_unit, self._decode_token_cost = load_unit, decode_token_cost
        self._placements: dict[str, _Placement] = {}  # internal request id -> where it went
        self._ended: deque[_Placement] = deque()  # sent and ended lately, in the order they ended
        self._shadow = CacheShadow()
        self._metrics = RouterMetrics()
        self._adapters_routed: dict[str, float] = {}  # adapter -> when this router last routed it
        self._adapter_homes: tuple[object, dict[str, str]] = (None, {})  # (what they were computed from, homes)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """First rank: the chosen replica. Second, only where Serve knows it is full: the
        rest. Serve also moves on to the next rank when its probe of a replica it has no
        fresh count for times out (0.1 s at first: a busy machine), which would send the
        request where the bound did not choose (a burst's spills all landed home); with one
        rank, Serve asks again, with a longer deadline."""
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        prompt = read_prompt(pending_request, _block_size(candidate_replicas))
        choice, work = self._choose(prompt, candidate_replicas)
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            self._placements[request_id] = _Placement(choice.replica_id, choice, time.time(), work,
                                                      None if prompt is None else prompt.adapter)
        if prompt is not None:
            self._shadow.record(choice.replica_id, prompt.hashes, _num_kv_blocks(by_id[choice.replica_id]))
        chosen = by_id.pop(choice.replica_id)
        return [[chosen], list(by_id.values())] if by_id and self._is_full(chosen) else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        placement = self._placements.get(pending_request.metadata.internal_request_id)
        # Refused by its choice and sent to another: that is a spill too.
        is_choice = placement is not None and placement.choice.replica_id == replica_id.unique_id
        self._metrics.record_routed(replica_id.unique_id, placement.choice.decision if is_choice else "spill")
        if placement is not None:
            placement.replica_id, placement.routed_at = replica_id.unique_id, time.time()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        placement = self._placements.pop(internal_request_id, None)
        if placement is not None and placement.is_routed:
            placement.ended_at = time.time()
            self._ended.append(placement)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this when the replica set or a replica's routing stats change."""
        super().update_replicas(replicas)
        self._shadow.keep_only(r.replica_id.unique_id for r in replicas)
        self._metrics.record_replicas({r.replica_id.unique_id: r.routing_stats or {} for r in replicas})

    def _choose(self, prompt: _Prompt | None, replicas: list[RunningReplica]) -> tuple[Choice, float]:
        """The replica, and the work the request asks of it."""
        key = prompt.key(self._key_blocks) if prompt is not None else None
        homes = None if prompt is None or prompt.adapter is None else self._homes(prompt.adapter, replicas)
        if self._load_unit == "requests":
            cached = None if prompt is None else {
                r.replica_id.unique_id: self._shadow.num_cached_blocks(r.replica_id.unique_id, prompt.hashes)
                for r in replicas}
            return choose(key, self._request_loads(replicas), self._eps, cached, homes), 1.0
        loads, costs = self._work_loads(prompt, replicas)
        choice = choose_by_work(key, loads, costs, self._eps, homes)
        return choice, costs[choice.replica_id]

    def _homes(self, adapter: str, replicas: list[RunningReplica]) -> dict[str, int]:
        """How each replica stands to the adapter: its home (_home), else as adapter_standing
        reads the replica's report and this router's sends. This router's sends: its
        open requests, where Serve sent them (else where last chosen: Serve asks again for
        a request whose replica did not answer in time, and only the last choice counts),
        as of now; those ended lately, as of their choice."""
        now, sends = time.time(), {}
        for placement in self._recently_ended():
            if placement.adapter is not None:
                sends.setdefault(placement.replica_id, {})[placement.adapter] = placement.chosen_at
        for placement in self._live_placements():
            if placement.adapter is not None:
                sends.setdefault(placement.replica_id, {})[placement.adapter] = now
        home = self._home(adapter, replicas, now)
        return {r.replica_id.unique_id: HOME if r.replica_id.unique_id == home else adapter_standing(
                    adapter, r.routing_stats or {}, sends.get(r.replica_id.unique_id, {}), now) for r in replicas}

    def _home(self, adapter: str, replicas: list[RunningReplica], now: float) -> str:
        """The adapter's home (assign_homes), over the adapters routed lately, this one
        included; computed again only when those or the replicas' caps change."""
        self._adapters_routed = recent_adapters(self._adapters_routed | {adapter: now}, now, _ADAPTER_WINDOW_S)
        caps = {r.replica_id.unique_id: (r.routing_stats or {}).get("max_loras") for r in replicas}
        basis = (frozenset(self._adapters_routed), frozenset(caps.items()))
        if self._adapter_homes[0] != basis:
            self._adapter_homes = (basis, assign_homes(self._adapters_routed, caps))
        return self._adapter_homes[1][adapter]

    def _request_loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Each replica's open requests (request_load)."""
        live, ended, now = self._live_placements(), self._recently_ended(), time.time()
        return {r.replica_id.unique_id: request_load(
                    r.routing_stats or {}, self._queue_len(r),
                    [p.chosen_at for p in live if p.replica_id == r.replica_id.unique_id],
                    [(p.chosen_at, p.ended_at) for p in ended if p.replica_id == r.replica_id.unique_id], now)
                for r in replicas}

    def _work_loads(self, prompt: _Prompt | None,
                    replicas: list[RunningReplica]) -> tuple[dict[str, float], dict[str, float]]:
        """Each replica's open work, and this request's work on it."""
        live, loads, costs = self._live_placements(), {}, {}
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            costs[replica_id] = self._cost(prompt, replica_id)
            loads[replica_id] = self._work_load(replica, [p for p in live if p.replica_id == replica_id], costs[replica_id])
        return loads, costs

    def _work_load(self, replica: RunningReplica, mine: list[_Placement], cost: float) -> float:
        """The work the replica last reported still ahead of it (every router's requests,
        prefills and decodes already done subtracted), plus this router's requests the
        report cannot hold: those the replica had not yet taken when it reported. Where its
        report is missing or old: this router's requests at their cost when chosen, and the
        rest of Serve's count (other routers') as this one would weigh there."""
        return work_load(replica.routing_stats or {}, self._queue_len(replica), [(p.work, p.routed_at) for p in mine],
                         cost, self._decode_token_cost, time.time())

    def _cost(self, prompt: _Prompt | None, replica_id: str) -> float:
        if prompt is None:  # not a generate call: no prompt, nothing to decode
            return 1.0
        num_cached = self._shadow.num_cached_blocks(replica_id, prompt.hashes) * prompt.block_size
        return request_work(prompt.num_tokens, num_cached, prompt.max_tokens, self._decode_token_cost)

    def _live_placements(self) -> list[_Placement]:
        """This router's requests chosen or sent, not completed; those chosen but never
        confirmed sent for _UNROUTED_TTL_S are forgotten."""
        expired_before = time.time() - _UNROUTED_TTL_S
        for request_id, placement in list(self._placements.items()):
            if not placement.is_routed and placement.chosen_at < expired_before:
                del self._placements[request_id]
        return list(self._placements.values())

    def _recently_ended(self) -> deque[_Placement]:
        """This router's sent requests that ended within _REPORT_MAX_AGE_S: a fresh report
        may still count them."""
        forget_before = time.time() - _REPORT_MAX_AGE_S
        while self._ended and self._ended[0].ended_at < forget_before:
            self._ended.popleft()
        return self._ended

    # replica_queue_len_cache is a property of Serve's public RequestRouter (alpha); its
    # ReplicaQueueLengthCache.get is what tests/test_serve_internals.py pins.
    def _is_full(self, replica: RunningReplica) -> bool:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return queue_len is not None and queue_len >= replica.max_ongoing_requests

    def _queue_len(self, replica: RunningReplica) -> int:
        """Serve's cached count (0 where it has none fresh)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


def work_load(report: dict, queue_len: int, mine: list[tuple[float, float | None]], cost: float,
              decode_token_cost: float, now: float) -> float:
    """A replica's open work as this router knows it (_work_load). mine: each of this
    router's open requests there, its work and when Serve told the router the replica took
    it (None: not yet).

    Serve tells a router that a replica took a request only after the replica has it, so
    a request confirmed before the report is in it. One not yet taken is not: counted as in
    the report once chosen before it, a report polled while a long request was on its way
    hid it, and a burst spilled off its home as if that request's replica were idle. One
    taken just before the report but confirmed after it counts twice until the next
    report: a spill too many, never a replica past the bound."""
    pending_at = report.get("pending_at", 0.0)
    if now - pending_at >= _REPORT_MAX_AGE_S:
        return sum(work for work, _ in mine) + max(queue_len - len(mine), 0) * cost
    pending = report["num_pending_prompt_tokens"] + decode_token_cost * report["num_pending_decode_tokens"]
    return pending + sum(work for work, routed_at in mine if routed_at is None or routed_at > pending_at)


def request_load(report: dict, queue_len: int, live: list[float], ended: list[tuple[float, float]],
                 now: float) -> int:
    """A replica's open requests as this router knows them: its own, exactly, and the other
    routers' as of the replica's last report. live: when this router chose each of its open
    requests there; ended: when it chose each of its requests there that ended lately, and
    when it heard of the end.

    The report counts every router's requests at reported_at; the others' are that count
    less this router's that may be in it: chosen before it and not ended by then. (One
    chosen before but not yet arrived, or ended but not yet heard of, makes the others'
    count low by one for a stats period; never this router's own.) Serve's count is no
    substitute while the report is fresh: it holds other routers' requests as of this
    router's last send or probe and never hears of their end, so for up to its 10 s
    timeout it counts requests long finished (a router that had sent nothing would spill a
    prefix's first request off its home). Where the report is stale or missing (a replica
    slow to answer Serve's poll): Serve's count, never fewer than this router's own."""
    reported_at = report.get("reported_at", 0.0)
    if now - reported_at >= _REPORT_MAX_AGE_S:
        return max(queue_len, len(live))
    mine_then = (sum(chosen_at <= reported_at for chosen_at in live)
                 + sum(chosen_at <= reported_at < ended_at for chosen_at, ended_at in ended))
    return len(live) + max(report["num_active"] - mine_then, 0)


def adapter_standing(adapter: str, report: dict, sent: dict[str, float], now: float) -> int:
    """HOLDS where the replica holds the adapter in a slot: as its last report said
    (lora_resident), or since this router sent it a request for it; else FREE_SLOT where
    those adapters leave one of its max_loras slots free; else NO_SLOT. sent: the adapters
    this router chose the replica for lately, and when. With the report stale or missing,
    this router's sends alone (and no free slot it can know of)."""
    reported_at = report.get("reported_at", 0.0)
    if now - reported_at >= _REPORT_MAX_AGE_S or "lora_resident" not in report:
        return HOLDS if adapter in sent else NO_SLOT
    held = set(report["lora_resident"]) | {name for name, at in sent.items() if at > reported_at}
    if adapter in held:
        return HOLDS
    return FREE_SLOT if len(held) < report["max_loras"] else NO_SLOT


def _check_kwargs(load_bound_eps: float, key_blocks: int, load_unit: str, decode_token_cost: float) -> None:
    if not load_bound_eps >= 0:
        raise ValueError(f"load_bound_eps must be >= 0, got {load_bound_eps!r}")
    if not (isinstance(key_blocks, int) and key_blocks >= 1):
        raise ValueError(f"key_blocks must be a positive integer, got {key_blocks!r}")
    if load_unit not in ("requests", "work"):
        raise ValueError(f"load_unit must be requests or work, got {load_unit!r}")
    if not decode_token_cost >= 0:
        raise ValueError(f"decode_token_cost must be >= 0, got {decode_token_cost!r}")


def read_prompt(pending_request: PendingRequest | None, block_size: int) -> _Prompt | None:
    """The prompt of an ingress -> engine `generate` call, read by its arguments' names (the
    Ingress passes them by keyword: deployments/api/engine_client.py); a call without them
    is routed by load alone."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    token_ids = pending_request.kwargs.get("prompt_token_ids")
    params = pending_request.kwargs.get("params")
    lora = pending_request.kwargs.get("lora")
    if not isinstance(token_ids, list):
        return None
    max_tokens = params.max_tokens if isinstance(params, SamplingParams) else 0
    adapter = lora.name if isinstance(lora, LoraRequest) else None
    salt = None if adapter is None else adapter_key(adapter)
    return _Prompt(block_hashes(token_ids, block_size, salt=salt), block_size, len(token_ids), max_tokens, adapter)


def _num_kv_blocks(replica: RunningReplica) -> int:
    return (replica.routing_stats or {}).get("num_kv_blocks") or DEFAULT_NUM_BLOCKS


def _block_size(replicas: list[RunningReplica]) -> int:
    for replica in replicas:
        block_size = (replica.routing_stats or {}).get("block_size")
        if block_size:
            return block_size
    return _ENGINE_BLOCK_SIZE
