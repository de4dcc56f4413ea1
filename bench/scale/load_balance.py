"""How evenly the engine replicas were loaded when requests arrived, from the replicas' own
load logs (bench/scale/load_log.py: LoadLog, read_load_logs): the load a router bounds, sampled at the moments it
bounds it, not averaged over a run's ramp-up and drain where no routing happens.

    over bound          arrivals that left their replica above (1 + eps) x the mean load
                        (every replica's open requests, this one included), where a whole
                        number of requests could have stayed within it: a router's breach;
                        "lasting" if still over with the next settle_s's arrivals in
    busiest / mean      the busiest replica's load over the mean load, summed over arrivals

Load is open requests, or, given a decode_token_cost, open work as the router's work bound
counts it (deployments/routing/prefix_routing.py request_work): each open request's prompt tokens
its replica likely did not hold when it arrived, plus decode_token_cost per token it may
decode. In work, an arrival is over the bound where it left its replica above (1 + eps) x
the mean work and above what another replica would have held had it taken the request as a
miss (the router's fallback where no replica is within the bound).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.scale.load_log import LoadEvent
from deployments.routing.prefix_routing import request_work


@dataclass(frozen=True)
class ArrivalLoads:
    num_arrivals: int
    num_over_bound: int  # at the arrival itself
    num_over_bound_lasting: int  # and still over with the next settle_s's arrivals in
    busiest_over_mean: float


def arrival_loads(logs: Mapping[str, Sequence[LoadEvent]], eps: float, settle_s: float = 0.05,
                  decode_token_cost: float | None = None, completion_lag_s: float = 0.0) -> ArrivalLoads:
    """logs: each replica's events, wall-clock timed on one machine (so they merge).
    Requests routed at the same moment reach their replicas in any order within a few
    milliseconds, so a breach counts as lasting only if the replica is still over the
    bound once the next settle_s's arrivals are counted too; that window's departures are
    not: they reach the router after the choice, which could not know of them (a replica
    that finishes early lowers the mean after the fact). decode_token_cost: load in work
    (see above), else in requests.
    completion_lag_s: judge loads as a router knows them, hearing of each request's end
    this much after its replica counted it (Serve reports a completion when the stream's
    end reaches the caller's loop), so that a replica finishing early does not count as a
    breach of a choice made before the router could know."""
    times, events, states = _timeline(logs, decode_token_cost, completion_lag_s)
    num_over = num_lasting = 0
    busiest_sum = mean_sum = 0.0
    arrivals = [i for i, (_, event) in enumerate(events) if event.delta > 0]
    for i in arrivals:
        replica_id, event = events[i]
        slack = 1.0 if decode_token_cost is None else _miss_work(event, decode_token_cost)
        later = _with_arrivals(states[i], events[i + 1:bisect.bisect_right(times, times[i] + settle_s)],
                               decode_token_cost)
        is_over = _is_over(states[i], replica_id, eps, slack, decode_token_cost is None)
        num_over += is_over
        num_lasting += is_over and _is_over(later, replica_id, eps, slack, decode_token_cost is None)
        busiest_sum += max(states[i].values())
        mean_sum += sum(states[i].values()) / len(states[i])
    return ArrivalLoads(len(arrivals), num_over, num_lasting, busiest_sum / max(mean_sum, 1e-9))


def _timeline(logs: Mapping[str, Sequence[LoadEvent]], decode_token_cost: float | None,
              completion_lag_s: float = 0.0) -> tuple[list[float], list[tuple[str, LoadEvent]], list[dict]]:
    """Every event in time order (a departure completion_lag_s late), its replica, and
    every replica's load after it. In requests, a replica starts from the requests it held
    before its first event (a log read from `since` may begin mid-request); in work, from 0."""
    logs = {replica_id: [LoadEvent(*event) for event in log] for replica_id, log in logs.items()}
    events = sorted(((_seen(event, completion_lag_s), replica_id) for replica_id, log in logs.items() for event in log),
                    key=lambda pair: pair[0].time)
    current = {replica_id: float(log[0].num_open - log[0].delta) if log and decode_token_cost is None else 0.0
               for replica_id, log in logs.items()}
    states = []
    for event, replica_id in events:
        current[replica_id] += event.delta * _weight(event, decode_token_cost)
        states.append(dict(current))
    return [e.time for e, _ in events], [(r, e) for e, r in events], states


def _with_arrivals(loads: Mapping[str, float], events: Sequence[tuple[str, LoadEvent]],
                   decode_token_cost: float | None) -> dict[str, float]:
    """loads with the arrivals among events added, their departures left out."""
    loads = dict(loads)
    for replica_id, event in events:
        if event.delta > 0:
            loads[replica_id] += _weight(event, decode_token_cost)
    return loads


def _seen(event: LoadEvent, completion_lag_s: float) -> LoadEvent:
    return event._replace(time=event.time + completion_lag_s) if event.delta < 0 else event


def _weight(event: LoadEvent, decode_token_cost: float | None) -> float:
    """What the event's request adds to its replica's load: one request, or its work."""
    return 1.0 if decode_token_cost is None else _work(event, decode_token_cost)


def _work(event: LoadEvent, decode_token_cost: float) -> float:
    return request_work(event.num_prompt_tokens, event.num_prompt_tokens - event.num_uncached_tokens,
                        event.max_tokens, decode_token_cost)


def _miss_work(event: LoadEvent, decode_token_cost: float) -> float:
    return request_work(event.num_prompt_tokens, 0, event.max_tokens, decode_token_cost)


def _is_over(loads: Mapping[str, float], replica_id: str, eps: float, slack: float, is_whole: bool) -> bool:
    """Above (1 + eps) x the mean, and above what the least loaded other replica would
    hold with slack more: in requests, where a whole number could be within the bound; in
    work, where another replica taking the request as a miss would have ended lower."""
    mean = sum(loads.values()) / len(loads)
    others = [load for other, load in loads.items() if other != replica_id]
    floor = math.ceil(mean - 1e-9) if is_whole else min(others, default=math.inf) + slack
    return loads[replica_id] > max(floor, (1 + eps) * mean) + 1e-9
