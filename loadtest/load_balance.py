"""How evenly the engine replicas were loaded when requests arrived, from the replicas' own
load logs (deployments/engine_load.py: LoadLog, read_load_logs): the load a router bounds, sampled at the moments it
bounds it, not averaged over a run's ramp-up and drain where no routing happens.

    over bound          arrivals that left their replica above (1 + eps) x the mean load
                        (every replica's open requests, this one included), where a whole
                        number of requests could have stayed within it: a router's breach;
                        "lasting" if still over settle_s later
    busiest / mean      the busiest replica's load over the mean load, summed over arrivals
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deployments.engine_load import LoadEvent


@dataclass(frozen=True)
class ArrivalLoads:
    num_arrivals: int
    num_over_bound: int  # at the arrival itself
    num_over_bound_lasting: int  # and still over settle_s later
    busiest_over_mean: float


def arrival_loads(logs: Mapping[str, Sequence[LoadEvent]], eps: float, settle_s: float = 0.05) -> ArrivalLoads:
    """logs: each replica's events, wall-clock timed on one machine (so they merge).
    Requests routed at the same moment reach their replicas in any order within a few
    milliseconds, so a breach counts as lasting only if the replica is still over the
    bound settle_s later."""
    times, replica_ids, deltas, states = _timeline(logs)
    num_over = num_lasting = 0
    busiest_sum = mean_sum = 0.0
    arrivals = [i for i, delta in enumerate(deltas) if delta > 0]
    for i in arrivals:
        is_over = _is_over(states[i], replica_ids[i], eps)
        later = states[bisect.bisect_right(times, times[i] + settle_s) - 1]
        num_over += is_over
        num_lasting += is_over and _is_over(later, replica_ids[i], eps)
        busiest_sum += max(states[i].values())
        mean_sum += sum(states[i].values()) / len(states[i])
    return ArrivalLoads(len(arrivals), num_over, num_lasting, busiest_sum / max(mean_sum, 1e-9))


def _timeline(logs: Mapping[str, Sequence[LoadEvent]]) -> tuple[list[float], list[str], list[int], list[dict]]:
    """Every event in time order: its time, replica, delta, and every replica's load after it."""
    events = sorted((time, replica_id, num_open, delta)
                    for replica_id, log in logs.items() for time, num_open, delta in log)
    current = dict.fromkeys(logs, 0)
    states = []
    for _, replica_id, num_open, _ in events:
        current[replica_id] = num_open
        states.append(dict(current))
    return [e[0] for e in events], [e[1] for e in events], [e[3] for e in events], states


def _is_over(loads: Mapping[str, int], replica_id: str, eps: float) -> bool:
    """Above (1 + eps) x the mean, where a whole number of requests could be within it."""
    mean = sum(loads.values()) / len(loads)
    return loads[replica_id] > max(math.ceil(mean - 1e-9), (1 + eps) * mean + 1e-9)
