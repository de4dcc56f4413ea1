"""Routing a LoRA adapter's requests (deployments/routing/adapter_homes.py; prefix_routing.py,
adapter; router.py adapter_standing): to the adapter's home, the same in every router, within the
load bound; past it, to a replica holding the adapter in a slot, then to a free slot; with
prefix affinity kept within an adapter."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, OrderedDict

from ray.serve._private.common import RequestMetadata  # how Serve hands a router a call (alpha API)
from ray.serve.request_router import PendingRequest

from deployments.routing.adapter_homes import assign_homes, recent_adapters
from deployments.routing.prefix_routing import (
    FREE_SLOT, HOLDS, HOME, NO_SLOT, Choice, adapter_key, block_hashes, choose, choose_by_work, load_bound, rendezvous_order,
)
from deployments.routing.router import adapter_standing, read_prompt
from engine import SamplingParams
from engine.request.lora_request import LoraRequest

BLOCK = 16
REPLICAS = ["replica-0", "replica-1"]
EPS = 0.75


def test_an_adapter_goes_to_the_replica_holding_it_not_its_rendezvous_home():
    key = adapter_key("sql")
    home, other = rendezvous_order(key, REPLICAS)
    choice = choose(key, {home: 0, other: 0}, EPS, {}, {home: NO_SLOT, other: HOLDS})
    assert (choice.replica_id, choice.decision) == (other, "affinity")


def test_the_holder_past_the_load_bound_spills_its_adapter_to_the_other():
    key = adapter_key("sql")
    holder, other = REPLICAS
    loads = {holder: 7, other: 1}
    assert loads[holder] + 1 > load_bound(sum(loads.values()), 2, EPS)
    choice = choose(key, loads, EPS, {}, {holder: HOLDS, other: NO_SLOT})
    assert (choice.replica_id, choice.decision) == (other, "spill")


def test_an_adapter_no_replica_holds_takes_a_free_slot_before_evicting_one():
    for name in (f"adapter-{i}" for i in range(8)):
        full, free = rendezvous_order(adapter_key(name), REPLICAS)  # its home has no free slot
        choice = choose(adapter_key(name), {full: 2, free: 2}, EPS, {}, {full: NO_SLOT, free: FREE_SLOT})
        assert choice.replica_id == free


def test_an_adapter_no_replica_holds_is_placed_at_the_even_split():
    key = adapter_key("cold")
    first, second = rendezvous_order(key, REPLICAS)
    choice = choose(key, {first: 3, second: 1}, EPS, {}, {first: FREE_SLOT, second: NO_SLOT})
    assert choice.replica_id == second  # 4 of 5 on one replica is past the even split's 3


def test_the_same_prompt_under_two_adapters_or_the_base_model_has_three_sets_of_block_keys():
    prompt = list(range(5 * BLOCK))
    keys = [block_hashes(prompt, BLOCK, salt=salt) for salt in (None, adapter_key("a"), adapter_key("b"))]
    assert len({tuple(k) for k in keys}) == 3
    assert block_hashes(prompt, BLOCK, salt=adapter_key("a")) == keys[1]  # and the same each time


def test_among_replicas_holding_the_adapter_the_one_with_the_prompts_blocks_comes_first():
    key = adapter_key("sql")
    home, other = rendezvous_order(key, REPLICAS)
    both = {home: HOLDS, other: HOLDS}
    assert choose(key, {home: 1, other: 1}, EPS, {home: 0, other: 3}, both).replica_id == other
    assert choose(key, {home: 1, other: 1}, EPS, {home: 0, other: 0}, both).replica_id == home


def test_by_work_the_holder_comes_before_a_cheaper_replica_within_the_bound():
    key = adapter_key("sql")
    holder, other = REPLICAS
    choice = choose_by_work(key, {holder: 100, other: 100}, {holder: 40, other: 20}, EPS,
                            {holder: HOLDS, other: NO_SLOT})
    assert choice.replica_id == holder


def report(resident: list[str], reported_at: float, max_loras: int = 2) -> dict:
    return {"lora_resident": resident, "max_loras": max_loras, "reported_at": reported_at}


def test_a_replica_holds_what_it_reported_and_what_this_router_sent_it_since():
    now = 100.0
    fresh = report(["a"], now - 1)
    assert adapter_standing("a", fresh, {}, now) == HOLDS
    assert adapter_standing("b", fresh, {"b": now - 0.5}, now) == HOLDS  # sent after the report
    assert adapter_standing("b", fresh, {"b": now - 2}, now) == FREE_SLOT  # sent before it, and not in it: evicted
    assert adapter_standing("c", fresh, {"b": now - 0.5}, now) == NO_SLOT  # a and b fill its 2 slots


def test_with_the_report_stale_or_missing_only_this_routers_sends_count():
    now = 100.0
    stale = report(["a"], now - 60)
    assert adapter_standing("a", stale, {}, now) == NO_SLOT
    assert adapter_standing("b", stale, {"b": now - 1}, now) == HOLDS
    assert adapter_standing("a", {}, {}, now) == NO_SLOT


class SimulatedReplica:
    """An engine replica's slots: LRU over max_loras, as engine/lora/registry.py evicts."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras, self.slots = max_loras, OrderedDict()

    def arrive(self, adapter: str) -> bool:
        """Whether the adapter was resident; it is now, the least recently used evicted."""
        was_resident = adapter in self.slots
        self.slots[adapter] = True
        self.slots.move_to_end(adapter)
        if len(self.slots) > self.max_loras:
            self.slots.popitem(last=False)
        return was_resident


def routed(adapter: str, loads: dict[str, int], homes: dict[str, str], standings: dict[str, int]) -> str:
    """Where the router sends a request for adapter (router.py _homes): its home ranks first."""
    ranks = {r: HOME if r == homes[adapter] else standings[r] for r in loads}
    return choose(adapter_key(adapter), loads, EPS, {}, ranks).replica_id


def test_sixteen_adapters_over_two_replicas_of_eight_slots_land_resident_nine_times_in_ten_with_no_report_of_slots():
    """The issue's goal in a simulation that withholds every replica's report of its slots:
    reports lagging 16 arrivals left the report-led router at 98% here, 47-55% on the real
    bench (BENCHMARKS.md, LoRA), so a simulated report flatters; homes must not need one
    (that router, blind: 61%). Adapters are seen in the order they arrive (homes over those
    seen so far, so early homes move); a steady load of 16 open requests, the oldest ending
    as each new one arrives. The real figure is the bench's."""
    rng = random.Random(0)
    replicas = {replica_id: SimulatedReplica(8) for replica_id in REPLICAS}
    open_requests: list[str] = []
    seen: set[str] = set()
    arrivals = Counter()
    for _ in range(3000):
        adapter = f"adapter-{rng.randrange(16)}"
        seen.add(adapter)
        loads = Counter(open_requests)
        homes = assign_homes(seen, dict.fromkeys(REPLICAS, 8))
        chosen = routed(adapter, {r: loads[r] for r in REPLICAS}, homes, dict.fromkeys(REPLICAS, NO_SLOT))
        assert loads[chosen] + 1 <= load_bound(len(open_requests), 2, EPS)
        arrivals[replicas[chosen].arrive(adapter)] += 1
        open_requests = (open_requests + [chosen])[-16:]
    assert arrivals[True] / sum(arrivals.values()) >= 0.9


def test_sixteen_adapters_over_two_replicas_of_eight_slots_get_eight_homes_each_whatever_the_arrival_order():
    names = [f"adapter-{i}" for i in range(16)]
    caps = dict.fromkeys(REPLICAS, 8)
    homes = assign_homes(names, caps)
    assert Counter(homes.values()) == dict.fromkeys(REPLICAS, 8)
    for seed in range(5):
        random.Random(seed).shuffle(names)
        assert assign_homes(names, caps) == homes


def test_an_adapter_past_every_replicas_slots_goes_to_its_rendezvous_first():
    names = [f"adapter-{i}" for i in range(17)]
    homes = assign_homes(names, dict.fromkeys(REPLICAS, 8))
    full = max(names, key=adapter_key)  # placed last, when all 16 homes are taken
    assert homes[full] == rendezvous_order(adapter_key(full), REPLICAS)[0]
    assert sorted(Counter(homes.values()).values()) == [8, 9]


def test_before_any_report_of_max_loras_homes_are_plain_rendezvous():
    names = [f"adapter-{i}" for i in range(16)]
    homes = assign_homes(names, dict.fromkeys(REPLICAS, None))
    assert homes == {name: rendezvous_order(adapter_key(name), REPLICAS)[0] for name in names}


def test_a_replica_leaving_moves_its_own_adapters_and_with_slots_to_spare_no_other():
    names = [f"adapter-{i}" for i in range(12)]
    three = ["replica-0", "replica-1", "replica-2"]
    before = assign_homes(names, dict.fromkeys(three, 8))
    after = assign_homes(names, dict.fromkeys(three[:2], 8))
    assert {name for name in names if before[name] != after[name]} == {
        name for name in names if before[name] == "replica-2"} != set()


def test_an_adapter_not_routed_within_the_window_frees_its_home():
    assert recent_adapters({"a": 10.0, "b": 90.0}, 100.0, 60.0) == {"b": 90.0}


def test_a_request_goes_to_its_adapters_home_within_the_bound_and_spills_past_it():
    key = adapter_key("sql")
    home, other = rendezvous_order(key, REPLICAS)[::-1]  # a home that is not its rendezvous first
    ranks = {home: HOME, other: HOLDS}
    assert choose(key, {home: 5, other: 1}, EPS, {}, ranks) == Choice(home, "affinity")
    assert load_bound(8, 2, EPS) < 8
    assert choose(key, {home: 7, other: 1}, EPS, {}, ranks) == Choice(other, "spill")
    assert choose_by_work(key, {home: 50, other: 10}, {home: 10, other: 10}, EPS, ranks).replica_id == home
    assert choose_by_work(key, {home: 90, other: 10}, {home: 10, other: 10}, EPS, ranks).replica_id == other


def test_the_router_reads_a_generate_calls_adapter_and_salts_its_blocks_with_it():
    def call(lora: LoraRequest | None) -> PendingRequest:
        kwargs = {"prompt_token_ids": list(range(5 * BLOCK)), "params": SamplingParams(max_tokens=8), "lora": lora}
        # A future of its own: PendingRequest's default asks for the thread's event loop, which
        # a test run without one (this module alone on its worker) does not have.
        future = asyncio.new_event_loop().create_future()
        return PendingRequest([], kwargs, RequestMetadata("r", "r", call_method="generate"), future=future)

    base, sql = read_prompt(call(None), BLOCK), read_prompt(call(LoraRequest("sql", "/adapters/sql")), BLOCK)
    assert (base.adapter, sql.adapter) == (None, "sql")
    assert sql.key(4) == adapter_key("sql") and base.key(4) == base.hashes[3]
    assert sql.hashes == block_hashes(list(range(5 * BLOCK)), BLOCK, salt=adapter_key("sql")) != base.hashes
