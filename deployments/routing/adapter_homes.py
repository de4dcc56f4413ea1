"""Where each LoRA adapter lives: its home replica, computed alike by every router without
reading what the replicas hold.

    recent   the adapters a router has routed within a window: the set it places
    order    adapters in order of adapter_key (not of arrival), so routers that have seen
             the same adapters assign the same homes whatever order they saw them in
    home     each adapter, in that order, to the first replica in its rendezvous order
             with fewer homes than that replica's max_loras (bounded-load consistent
             hashing over adapters); with no free home anywhere, or a replica's cap not yet
             reported, the rendezvous first: a replica holds its homes and nothing else

Why not the replicas' reports of what they hold: a report lags the replica's admissions, so
an adapter went to both replicas and another to neither, each request for it evicting a
third, and the misses chained (47-55% of requests on a replica holding their adapter;
BENCHMARKS.md, LoRA). Homes depend only on names and caps.

Pure functions, no Ray: deployments/routing/router.py keeps the recent set and the replicas.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from deployments.routing.prefix_routing import adapter_key, rendezvous_order


def assign_homes(adapters: Iterable[str], max_loras: Mapping[str, int | None]) -> dict[str, str]:
    """adapter -> its home replica. max_loras: each replica's slots (None: not reported yet,
    no cap). Adapters past every replica's cap go to their rendezvous first."""
    replica_ids = list(max_loras)
    if not replica_ids:
        return {}
    num_homes = dict.fromkeys(replica_ids, 0)
    homes: dict[str, str] = {}
    for adapter in sorted(set(adapters), key=lambda name: (adapter_key(name), name)):
        order = rendezvous_order(adapter_key(adapter), replica_ids)
        free = [r for r in order if max_loras[r] is None or num_homes[r] < max_loras[r]]
        homes[adapter] = free[0] if free else order[0]
        num_homes[homes[adapter]] += 1
    return homes


def recent_adapters(last_routed: Mapping[str, float], now: float, window_s: float) -> dict[str, float]:
    """last_routed less the adapters not routed within window_s of now: an adapter no
    longer asked for frees its home."""
    return {name: at for name, at in last_routed.items() if at >= now - window_s}
