"""The router's policy (deployments/routing/prefix_routing.py) on its own: a prompt's key is the
engine's own prefix-cache key, every process computes the same one, rendezvous order moves
few keys when replicas come and go, and the load bound caps every replica."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter

from deployments.routing.prefix_routing import (
    Choice, block_hashes, choose, choose_by_work, load_bound, prefix_key, rendezvous_order, request_work,
)
from deployments.routing.cache_shadow import CacheShadow
from bench.scale.load_log import LoadLog, read_load_logs
from deployments.routing.router import request_load, work_load
from engine.core.block_manager import BlockManager
from engine.request.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from bench.scale.load_balance import arrival_loads

BLOCK = 16
REPLICAS = [f"replica-{i}" for i in range(4)]


def engine_block_hashes(tokens: list[int]) -> list[int]:
    """The hashes the engine's prefix cache files tokens' full blocks under."""
    manager = BlockManager(64, BLOCK)
    seq = Sequence("r", tokens, SamplingParams(), BLOCK)
    manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.commit_full_blocks(seq)
    return seq.block_hashes


def test_the_key_is_the_engines_prefix_cache_key_of_the_leading_blocks():
    tokens = list(range(1000, 1000 + 5 * BLOCK + 3))
    hashes = engine_block_hashes(tokens)
    assert prefix_key(tokens, BLOCK, key_blocks=4) == hashes[3]
    assert prefix_key(tokens, BLOCK, key_blocks=2) == hashes[1]
    assert prefix_key(tokens, BLOCK, key_blocks=99) == hashes[4]  # every full block but the last token's


def test_prompts_sharing_the_leading_blocks_share_a_key_and_others_do_not():
    prefix = list(range(4 * BLOCK))
    assert prefix_key(prefix + [1, 2, 3], BLOCK, 4) == prefix_key(prefix + [7] * 40, BLOCK, 4)
    assert prefix_key([5] + prefix[1:] + [1], BLOCK, 4) != prefix_key(prefix + [1], BLOCK, 4)


def test_a_prompt_without_a_full_block_has_no_key():
    assert prefix_key(list(range(BLOCK)), BLOCK, 4) is None  # its last token is never cached
    assert prefix_key(list(range(BLOCK + 1)), BLOCK, 4) is not None


def test_every_process_computes_the_same_keys_and_order():
    """Several ingress replicas route at once, each with its own router: they agree only if
    the key and the order do not depend on the process (Python salts str hashes)."""
    tokens = list(range(300))
    code = ("import json; from deployments.routing.prefix_routing import prefix_key, rendezvous_order; "
            f"k = prefix_key({tokens}, {BLOCK}, 4); print(json.dumps([k, rendezvous_order(k, {REPLICAS})]))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
               for _ in range(2)}
    key = prefix_key(tokens, BLOCK, 4)
    assert outputs == {json.dumps([key, rendezvous_order(key, REPLICAS)]) + "\n"}


def test_removing_a_replica_moves_only_the_keys_it_was_first_choice_for():
    keys = [prefix_key(list(range(i, i + 80)), BLOCK, 4) for i in range(400)]
    before = {key: rendezvous_order(key, REPLICAS)[0] for key in keys}
    after = {key: rendezvous_order(key, REPLICAS[:3])[0] for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == "replica-3" for key in moved)
    assert min(Counter(before.values()).values()) > 400 / 4 * 0.6  # and spreads them evenly


def test_a_key_goes_to_its_first_choice_while_that_is_within_the_bound():
    key = prefix_key(list(range(100)), BLOCK, 4)
    first, second = rendezvous_order(key, REPLICAS[:2])
    assert choose(key, {first: 0, second: 0}, eps=0.25).replica_id == first
    assert choose(key, {first: 4, second: 4}, eps=0.25).decision == "affinity"


def test_past_the_bound_a_key_spills_to_its_second_choice():
    key = prefix_key(list(range(100)), BLOCK, 4)
    order = rendezvous_order(key, REPLICAS)
    loads = {order[0]: 10, order[1]: 1, order[2]: 0, order[3]: 0}
    choice = choose(key, loads, eps=0.25)
    assert (choice.replica_id, choice.decision) == (order[1], "spill")  # not the least loaded


def test_the_bound_is_within_one_plus_eps_times_the_mean_counting_the_new_request():
    assert load_bound(15, 2, eps=0.25) == 10  # 16 in flight: 10 is 1.25 x the mean of 8
    assert load_bound(14, 2, eps=0.25) == 9  # 15: 9.375 allowed, so 9 (a ceiling gave 10, 1.33x)
    assert load_bound(99, 4, eps=0.1) == 27  # 1.1 x 25 = 27.5
    assert load_bound(2, 2, eps=0.25) == 2  # 3 in flight: no whole split within 1.25x; 2 + 1 is the best


def test_a_fresh_report_outweighs_serves_count_of_another_routers_requests_long_ended():
    # Serve's count probed 1 while another router's request ran; that request ended, as the
    # replica's report 0.2 s ago says. Counting the 1 would spill this router's next request.
    now = 1000.0
    assert request_load({"num_active": 0, "reported_at": now - 0.2}, queue_len=1, live=[], ended=[], now=now) == 0


def test_a_router_counts_its_own_requests_exactly_and_the_others_as_reported():
    # The report counted 3: this router's request chosen before it (still open), its
    # request that has ended since, and another router's. This router now has 3 open.
    now = 1000.0
    report = {"num_active": 3, "reported_at": now - 0.2}
    live, ended = [now - 0.5, now - 0.1, now - 0.01], [(now - 0.6, now - 0.05), (now - 0.15, now - 0.1)]
    assert request_load(report, queue_len=0, live=live, ended=ended, now=now) == 3 + 1


def test_a_report_that_missed_a_routers_requests_never_lowers_its_own_count():
    # Chosen before the report, not yet in the replica when it counted: the others' count
    # comes out low (0), this router's own still counts.
    now = 1000.0
    report = {"num_active": 1, "reported_at": now - 0.1}
    assert request_load(report, queue_len=0, live=[now - 0.3, now - 0.2], ended=[], now=now) == 2


def test_where_the_report_is_stale_serves_count_stands_never_below_the_routers_own():
    now = 1000.0
    stale = {"num_active": 5, "reported_at": now - 60}
    assert request_load(stale, queue_len=4, live=[now - 1, now - 0.1], ended=[], now=now) == 4
    assert request_load(stale, queue_len=1, live=[now - 1, now - 0.1], ended=[], now=now) == 2
    assert request_load({}, queue_len=0, live=[now - 0.1], ended=[], now=now) == 1  # no report yet


def test_in_work_a_report_made_while_a_routers_request_was_on_its_way_still_counts_it():
    # 1000 tokens of work chosen 0.5 s ago, taken by the replica 0.1 s ago; the report is
    # 0.2 s old and shows 50 left of another request: it cannot hold this router's.
    now, report = 1000.0, {"num_pending_prompt_tokens": 10, "num_pending_decode_tokens": 40, "pending_at": 1000.0 - 0.2}
    assert work_load(report, 0, [(1000.0, now - 0.1)], cost=40, decode_token_cost=1.0, now=now) == 50 + 1000
    assert work_load(report, 0, [(1000.0, None)], cost=40, decode_token_cost=1.0, now=now) == 50 + 1000  # not yet taken
    # Taken before the report: the report holds what is left of it.
    assert work_load(report, 0, [(1000.0, now - 0.3)], cost=40, decode_token_cost=1.0, now=now) == 50


def test_in_work_where_the_report_is_stale_the_routers_own_and_serves_count_stand_in():
    now, stale = 1000.0, {"num_pending_prompt_tokens": 10, "num_pending_decode_tokens": 40, "pending_at": 1000.0 - 60}
    assert work_load(stale, 3, [(100.0, now - 1)], cost=40, decode_token_cost=1.0, now=now) == 100 + 2 * 40
    assert work_load({}, 0, [(100.0, None)], cost=40, decode_token_cost=1.0, now=now) == 100  # no report yet


def test_a_hot_key_never_puts_a_replica_past_eps_times_the_mean_while_requests_come_and_go():
    """One key, requests arriving and finishing at random: every placement leaves its
    replica within (1 + eps) x the mean, counting the new request, unless no whole number
    is (then at the even split, ceil(mean))."""
    rng = random.Random(0)
    key = prefix_key(list(range(100)), BLOCK, 4)
    loads = dict.fromkeys(REPLICAS[:2], 0)
    for _ in range(2000):
        if rng.random() < 0.45 and sum(loads.values()):
            loads[rng.choice([r for r, load in loads.items() if load])] -= 1
            continue
        replica = choose(key, loads, eps=0.25).replica_id
        loads[replica] += 1
        mean = sum(loads.values()) / len(loads)
        assert loads[replica] <= max(math.ceil(mean), 1.25 * mean), loads
    assert sum(loads.values()) > 40  # the walk reached loads where the bound bites


def test_arrival_loads_count_the_placements_past_the_bound_from_the_replicas_logs():
    # Arrivals: t=1 a holds 1 of 1 (the even split: fine); t=2 a holds 2 of 2 (1/1 was
    # possible: over); t=3 b holds 1 of 3 (fine); t=4 a holds 3 of 4 (mean 2, bound 2.5: over).
    # 1.5 s later: t=2's breach has ended (b took one at t=3), t=4's has not (a 3 of 3).
    logs = {"a": [(1.0, 1, 1), (2.0, 2, 1), (4.0, 3, 1)], "b": [(3.0, 1, 1), (5.0, 0, -1)]}
    loads = arrival_loads(logs, eps=0.25, settle_s=1.5)
    assert (loads.num_arrivals, loads.num_over_bound, loads.num_over_bound_lasting) == (4, 2, 1)
    assert loads.busiest_over_mean == (1 + 2 + 2 + 3) / (0.5 + 1 + 1.5 + 2)


def test_arrival_loads_judge_a_departure_as_the_router_hears_of_it_completion_lag_late():
    # b's two requests end at t=1.01; a's 4th arrives at t=1.02. Counted at once, a holds 4
    # of 4 (mean 2, bound 3: over); counted 0.1 s late, as the router can know it, a holds 4
    # of 6 (mean 3, bound 4.5: within). A breach after the lag still counts.
    logs = {"a": [(1.0, 1, 1), (1.001, 2, 1), (1.002, 3, 1), (1.02, 4, 1), (1.5, 5, 1)],
            "b": [(1.0005, 1, 1), (1.0015, 2, 1), (1.01, 1, -1), (1.01, 0, -1)]}
    at_once = arrival_loads(logs, eps=0.5)
    lagged = arrival_loads(logs, eps=0.5, completion_lag_s=0.1)
    assert (at_once.num_over_bound, at_once.num_over_bound_lasting) == (2, 2)  # t=1.02 and t=1.5
    assert (lagged.num_over_bound, lagged.num_over_bound_lasting) == (1, 1)  # t=1.5 only


def test_arrival_loads_judge_a_lasting_breach_by_the_arrivals_that_follow_not_the_departures():
    # Two requests routed at once reach a first (t=1.001: a holds 2 of 2, over) and then b
    # (t=1.002: 2 of 3, within): no lasting breach, though b's request ends at t=1.01, inside
    # the settle window: that came after the choice, which could not foresee it. At t=2, a
    # takes a 3rd while b holds none (3 of 3): over, and nothing that arrives after helps.
    logs = {"a": [(1.0, 1, 1), (1.001, 2, 1), (2.0, 3, 1)], "b": [(1.002, 1, 1), (1.01, 0, -1)]}
    loads = arrival_loads(logs, eps=0.5)
    assert (loads.num_arrivals, loads.num_over_bound, loads.num_over_bound_lasting) == (4, 2, 1)


def test_arrival_loads_count_the_requests_a_log_read_mid_request_began_with():
    # Read from `since`, a's log starts at its 3rd open request: it held 2 before. With them,
    # b's arrival leaves b at 1 of 4 (fine) and a's next leaves a at 4 of 5 (mean 2.5: over).
    logs = {"a": [(1.0, 3, 1), (1.2, 4, 1)], "b": [(1.1, 1, 1)]}
    loads = arrival_loads(logs, eps=0.25, completion_lag_s=0.1)
    assert (loads.num_arrivals, loads.num_over_bound) == (3, 2)  # a's 3rd (3 of 3) and 4th
    assert loads.busiest_over_mean == (3 + 3 + 4) / (1.5 + 2 + 2.5)


def test_a_prompt_no_replica_holds_goes_where_the_load_is_even_not_past_its_home():
    """No shared prefix (or one not seen yet): affinity buys nothing, so the bound is the
    even split. Home at 4 of 7 would be within 1.5 x the mean; it goes to the other."""
    key = prefix_key(list(range(100)), BLOCK, 4)
    home, other = rendezvous_order(key, REPLICAS[:2])
    cold = {home: 0, other: 0}
    assert choose(key, {home: 3, other: 3}, eps=0.5, cached=cold) == Choice(home, "affinity")  # within the even split
    assert choose(key, {home: 4, other: 3}, eps=0.5, cached=cold) == Choice(other, "spill")
    assert choose(key, {home: 4, other: 3}, eps=0.5) == Choice(home, "affinity")  # without a shadow: rendezvous


def test_a_prefix_stays_where_it_is_cached_even_where_a_spill_put_it():
    key = prefix_key(list(range(100)), BLOCK, 4)
    home, other = rendezvous_order(key, REPLICAS[:2])
    assert choose(key, {home: 0, other: 0}, eps=0.5, cached={home: 0, other: 6}) == Choice(other, "affinity")
    assert choose(key, {home: 0, other: 0}, eps=0.5, cached={home: 6, other: 6}) == Choice(home, "affinity")
    assert choose(key, {home: 2, other: 3}, eps=0.5, cached={home: 0, other: 6}) == Choice(other, "affinity")  # 4 of 6
    assert choose(key, {home: 1, other: 4}, eps=0.5, cached={home: 0, other: 6}) == Choice(home, "spill")


def test_requests_without_a_key_go_to_the_least_loaded():
    assert choose(None, {"a": 3, "b": 1, "c": 2}, eps=0.25).replica_id == "b"


def test_block_hashes_are_the_engines_keys_of_the_prompts_full_blocks():
    tokens = list(range(2000, 2000 + 5 * BLOCK + 3))
    assert block_hashes(tokens, BLOCK) == engine_block_hashes(tokens)
    exact = tokens[:5 * BLOCK]  # its last block holds the last token, always computed: no key
    assert block_hashes(exact, BLOCK) == engine_block_hashes(exact)[:4]
    assert block_hashes(tokens, BLOCK, max_blocks=2) == engine_block_hashes(tokens)[:2]


def test_a_request_works_its_replica_for_the_prompt_it_does_not_hold_and_what_it_decodes():
    assert request_work(272, 0, 16, decode_token_cost=1.0) == 288  # a miss
    assert request_work(272, 256, 16, decode_token_cost=1.0) == 32  # its 256-token prefix cached
    assert request_work(272, 256, 16, decode_token_cost=2.0) == 48


def test_a_home_full_of_cached_prefixes_keeps_a_request_the_request_count_bound_spills():
    """6 requests at home, 1 elsewhere, eps 0.5: the 8th passes 1.5 x the mean in requests,
    but its home holds its prefix (and so its other six), so in work it is within the
    bound, while on the other replica it would be a miss."""
    key = prefix_key(list(range(100)), BLOCK, 4)
    home, other = rendezvous_order(key, REPLICAS[:2])
    assert choose(key, {home: 6, other: 1}, eps=0.5) == Choice(other, "spill")
    hit, miss = request_work(272, 256, 16, 1.0), request_work(272, 0, 16, 1.0)
    assert choose_by_work(key, {home: 6 * hit, other: miss}, {home: hit, other: miss}, eps=0.5) == Choice(home, "affinity")


def test_in_work_a_home_past_the_bound_spills_to_its_second_choice():
    key = prefix_key(list(range(100)), BLOCK, 4)
    order = rendezvous_order(key, REPLICAS)
    miss = request_work(272, 0, 16, 1.0)
    loads = {order[0]: 4 * miss, order[1]: miss, order[2]: 0.0, order[3]: 0.0}
    assert choose_by_work(key, loads, dict.fromkeys(REPLICAS, miss), eps=0.5) == Choice(order[1], "spill")


def test_in_work_past_every_bound_the_replica_ending_with_least_work_takes_it():
    """Little in flight: one miss outweighs the mean of the rest. Its home holds its
    prefix, so it ends with less work there than on an empty replica that would miss."""
    key = prefix_key(list(range(100)), BLOCK, 4)
    home, other = rendezvous_order(key, REPLICAS[:2])
    assert choose_by_work(key, {home: 200.0, other: 0.0}, {home: 32.0, other: 288.0}, eps=0.0) == Choice(home, "affinity")
    assert choose_by_work(key, {home: 300.0, other: 0.0}, {home: 32.0, other: 288.0}, eps=0.0) == Choice(other, "spill")


def test_in_work_every_placement_is_within_the_bound_or_ends_with_the_least_work():
    rng = random.Random(5)
    for _ in range(2000):
        key = rng.getrandbits(60)
        loads = {r: float(rng.randrange(0, 2000)) for r in REPLICAS[:rng.randrange(1, 5)]}
        costs = {r: float(rng.choice([32, 288])) for r in loads}
        eps = rng.choice([0.0, 0.25, 0.5, 1.0])
        chosen = choose_by_work(key, loads, costs, eps).replica_id
        after = loads[chosen] + costs[chosen]
        within = after <= (1 + eps) * (sum(loads.values()) + costs[chosen]) / len(loads)
        assert within or after == min(loads[r] + costs[r] for r in loads), (loads, costs, eps, chosen)


def test_work_requests_without_a_key_go_where_they_end_with_least_work():
    assert choose_by_work(None, {"a": 300.0, "b": 10.0, "c": 40.0}, dict.fromkeys("abc", 20.0), 0.5).replica_id == "b"


def test_a_shadow_holds_the_leading_blocks_of_what_was_sent_to_each_replica():
    shadow = CacheShadow()
    prefix = list(range(4 * BLOCK))
    shadow.record("a", block_hashes(prefix + list(range(500, 540)), BLOCK))
    assert shadow.num_cached_blocks("a", block_hashes(prefix + [7] * 40, BLOCK)) == 4  # the shared prefix only
    assert shadow.num_cached_blocks("b", block_hashes(prefix + [7] * 40, BLOCK)) == 0
    assert shadow.num_cached_blocks("a", block_hashes([9] + prefix, BLOCK)) == 0  # a different first block


def test_a_shadow_forgets_the_least_recently_sent_blocks_past_the_pool_and_a_prompts_tail_first():
    shadow = CacheShadow()
    old, new = block_hashes(list(range(0, 3 * BLOCK + 1)), BLOCK), block_hashes(list(range(900, 900 + 2 * BLOCK + 1)), BLOCK)
    shadow.record("a", old, num_blocks=5)
    shadow.record("a", new, num_blocks=5)
    assert shadow.num_cached_blocks("a", new) == 2
    assert shadow.num_cached_blocks("a", old) == 3
    shadow.record("a", block_hashes(list(range(700, 700 + BLOCK + 1)), BLOCK), num_blocks=5)
    assert shadow.num_cached_blocks("a", old) == 2  # its last block went first
    shadow.keep_only(["b"])
    assert shadow.num_cached_blocks("a", new) == 0


def test_arrival_loads_in_work_weigh_each_request_by_the_prompt_its_replica_missed():
    """b takes a miss (288 in work), then a takes three requests on a prefix it holds (32
    each): past 1.25 x the mean in requests (3 of 4), well within it in work."""
    miss, hit = (272, 272, 16), (272, 16, 16)  # prompt tokens, of those not cached, max_tokens
    logs = {"b": [(1.0, 1, 1, *miss)], "a": [(2.0, 1, 1, *hit), (3.0, 2, 1, *hit), (4.0, 3, 1, *hit)]}
    in_requests = arrival_loads(logs, eps=0.25, settle_s=0.5)
    in_work = arrival_loads(logs, eps=0.25, settle_s=0.5, decode_token_cost=1.0)
    assert (in_requests.num_arrivals, in_requests.num_over_bound, in_requests.num_over_bound_lasting) == (4, 1, 1)
    assert (in_work.num_arrivals, in_work.num_over_bound, in_work.num_over_bound_lasting) == (4, 0, 0)


def test_arrival_loads_in_work_count_a_replica_past_the_bound_where_a_miss_elsewhere_ended_lower():
    """a holds a miss (288) and takes a hit (320) while b is empty: b taking it as a miss
    would have ended at 288, so that is over; b's miss a moment later ends the breach."""
    miss, hit = (272, 272, 16), (272, 16, 16)
    logs = {"a": [(1.0, 1, 1, *miss), (2.0, 2, 1, *hit)], "b": [(3.0, 1, 1, *miss)]}
    loads = arrival_loads(logs, eps=0.5, settle_s=1.5, decode_token_cost=1.0)
    assert (loads.num_arrivals, loads.num_over_bound, loads.num_over_bound_lasting) == (3, 1, 0)
    assert loads.busiest_over_mean == (288 + 320 + 320) / (144 + 160 + 304)


def test_a_load_log_records_what_each_request_asks_of_its_replica(tmp_path):
    log = LoadLog(tmp_path, "r1", BLOCK, num_kv_blocks=64)
    prefix = list(range(16 * BLOCK))
    log.arrived("x", prefix + list(range(900, 916)), max_tokens=16)
    log.arrived("y", prefix + list(range(800, 816)), max_tokens=8)  # its prefix was sent here: likely cached
    log.left("x")
    events = read_load_logs(tmp_path)["r1"]
    assert [(e.num_open, e.delta, e.num_prompt_tokens, e.num_uncached_tokens, e.max_tokens) for e in events] == [
        (1, 1, 272, 272, 16), (2, 1, 272, 16, 8), (1, -1, 272, 272, 16)]


def test_in_work_a_prefix_cached_only_on_its_second_choice_stays_there_while_it_is_within_the_bound():
    """A spill put the prefix on its second choice: computing it again at home would cost a
    miss there and a second copy in the pools."""
    key = prefix_key(list(range(100)), BLOCK, 4)
    home, second = rendezvous_order(key, REPLICAS[:2])
    costs = {home: 288.0, second: 32.0}
    assert choose_by_work(key, {home: 0.0, second: 64.0}, costs, eps=0.5) == Choice(second, "affinity")
    assert choose_by_work(key, {home: 0.0, second: 600.0}, costs, eps=0.5) == Choice(home, "spill")
