"""Which engine replica a prompt goes to: prefix affinity with a bound on load.

    key      the chain hash of the prompt's first `key_blocks` KV blocks: the very key the
             engine's prefix cache files those blocks under (engine/block_manager.py)
    order    replicas ranked by rendezvous hashing of (key, replica id): every router in
             every process ranks them the same way, and adding or removing a replica moves
             only the keys whose first choice it is
    bound    consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018):
             the first replica in that order whose load, with this request, stays within
             (1 + eps) x the mean load with this request; past it the request spills to the
             next one in the same order, so a hot prefix's overflow lands on one second
             home, not on all replicas

Pure functions, no Ray: deployments/router.py feeds them what Serve knows.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from engine.block_manager import chain_hash

Decision = Literal["affinity", "spill", "least_loaded"]


@dataclass(frozen=True)
class Choice:
    replica_id: str
    decision: Decision  # affinity: the key's first choice; spill: it was over the bound


def prefix_key(token_ids: Sequence[int], block_size: int, key_blocks: int) -> int | None:
    """The chain hash of the prompt's leading full blocks (at most key_blocks of them);
    None for a prompt too short to have a cacheable block. Like the engine's lookup, the
    last token never counts: it is always computed."""
    num_blocks = min(key_blocks, (len(token_ids) - 1) // block_size)
    key = None
    for index in range(num_blocks):
        key = chain_hash(key, tuple(token_ids[index * block_size:(index + 1) * block_size]))
    return key


def rendezvous_order(key: int, replica_ids: Sequence[str]) -> list[str]:
    """Replicas from most to least preferred for key; the same in every process."""
    return sorted(replica_ids, key=lambda replica_id: _weight(key, replica_id), reverse=True)


def _weight(key: int, replica_id: str) -> int:
    # hash() of a str is salted per process; routers in different processes must agree.
    digest = hashlib.blake2b(f"{key}/{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def load_bound(total_load: int, num_replicas: int, eps: float) -> int:
    """The most requests one replica may hold once this one is placed: the largest whole
    number within (1 + eps) x the mean, counting this request. Where no whole number is
    (few requests in flight: 2 of 3 over 2 replicas is 1.33 x the mean), the even split
    ceil(mean), which the least-loaded replica always meets."""
    mean = (total_load + 1) / num_replicas
    return max(math.ceil(mean), math.floor((1 + eps) * mean + 1e-9))


def choose(key: int | None, loads: Mapping[str, int], eps: float) -> Choice:
    """loads: every candidate replica's current load (requests in it)."""
    if key is None:
        return Choice(_least_loaded(loads), "least_loaded")
    order = rendezvous_order(key, list(loads))
    bound = load_bound(sum(loads.values()), len(loads), eps)
    for replica_id in order:
        if loads[replica_id] + 1 <= bound:
            return Choice(replica_id, "affinity" if replica_id == order[0] else "spill")
    raise AssertionError("with eps >= 0 the least-loaded replica is always within the bound")


def _least_loaded(loads: Mapping[str, int]) -> str:
    lowest = min(loads.values())
    return random.choice([replica_id for replica_id, load in loads.items() if load == lowest])
