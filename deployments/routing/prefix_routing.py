"""Which engine replica a prompt goes to: prefix affinity with a bound on load.

    key      the chain hash of the prompt's first `key_blocks` KV blocks: the very key the
             engine's prefix cache files those blocks under (engine/core/block_manager.py)
    order    replicas ranked by rendezvous hashing of (key, replica id): every router in
             every process ranks them the same way, and adding or removing a replica moves
             only the keys whose first choice it is
    bound    consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018):
             the first replica in that order whose load, with this request, stays within
             (1 + eps) x the mean load with this request; past it the request spills to the
             next one in the same order, so a hot prefix's overflow lands on one second
             home, not on all replicas
    load     in requests (`choose`), or in work (`choose_by_work`): the prompt tokens a
             replica must still compute plus the tokens it must decode, so a request whose
             prefix its replica holds weighs what it costs there, its suffix, and a
             request counts more on a replica that would miss its prefix
    cached   the replicas likely holding the prompt's blocks (the router's CacheShadow)
             come first, rendezvous order among equals; a prompt none holds is placed at
             the even split (eps 0), as a balancing router would: affinity pays only once
             a replica holds the prefix
    adapter  a request under a LoRA adapter is keyed by the adapter (adapter_key), so an
             adapter's requests share a home, and its prompts' blocks are salted by it, as
             the engine's are: prefix affinity holds within the adapter. Ahead of the cached
             order comes the adapter's home (adapter_homes.py: the same in every router,
             whatever the replicas last reported), then the replicas holding it in a slot,
             then those with a free slot; the home earns the bound, so an adapter's
             requests stay on one replica until it is past the bound

Pure functions, no Ray: deployments/routing/router.py feeds them what Serve knows.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from engine.core.block_manager import chain_hash

Decision = Literal["affinity", "spill", "least_loaded"]
# How a replica stands to a request's LoRA adapter, best first: it is the adapter's home
# (adapter_homes.py); it holds the adapter in a slot; it has a free slot; none of these (it
# would evict one).
HOME, HOLDS, FREE_SLOT, NO_SLOT = 3, 2, 1, 0


@dataclass(frozen=True)
class Choice:
    replica_id: str
    decision: Decision  # affinity: the key's first choice; spill: it was over the bound


def prefix_key(token_ids: Sequence[int], block_size: int, key_blocks: int) -> int | None:
    """The chain hash of the prompt's leading full blocks (at most key_blocks of them);
    None for a prompt too short to have a cacheable block."""
    hashes = block_hashes(token_ids, block_size, key_blocks)
    return hashes[-1] if hashes else None


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                 salt: int | None = None) -> list[int]:
    """The keys the engine's prefix cache files the prompt's full blocks under, first
    block first. Like the engine's lookup, the last token never counts: it is always
    computed. salt: the first block's seed (adapter_key for a LoRA adapter's prompt: the
    engine seeds those with the adapter's digest, which the router cannot read, so the
    router's keys are its own but part the same prompts the engine parts)."""
    num_blocks = (len(token_ids) - 1) // block_size
    hashes: list[int] = []
    for index in range(num_blocks if max_blocks is None else min(max_blocks, num_blocks)):
        previous = hashes[-1] if hashes else salt
        hashes.append(chain_hash(previous, tuple(token_ids[index * block_size:(index + 1) * block_size])))
    return hashes


def rendezvous_order(key: int, replica_ids: Sequence[str]) -> list[str]:
    """Replicas from most to least preferred for key; the same in every process."""
    return sorted(replica_ids, key=lambda replica_id: _weight(key, replica_id), reverse=True)


def adapter_key(name: str) -> int:
    """A LoRA adapter's key: the same in every process."""
    return int.from_bytes(hashlib.blake2b(f"lora/{name}".encode(), digest_size=8).digest(), "big")


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


def choose(key: int | None, loads: Mapping[str, int], eps: float, cached: Mapping[str, int] | None = None,
           homes: Mapping[str, int] | None = None) -> Choice:
    """loads: every candidate replica's current load (requests in it). cached: how many
    of the prompt's blocks each replica likely holds (a router's CacheShadow): those
    holding more come first, rendezvous order among equals, so a prefix stays where a
    spill computed it. Where no replica holds any (no shared prefix, or one not seen
    yet), affinity buys nothing, and the bound is the even split (eps 0): a cold prompt
    costs what it would under a balancing router. homes: for a request under a LoRA
    adapter, how each replica stands to it (HOME, HOLDS, FREE_SLOT, NO_SLOT), ranked ahead
    of cached; its home, or a replica holding it, earns the bound as a cached prefix does."""
    if key is None:
        return Choice(_least_loaded(loads), "least_loaded")
    order = rendezvous_order(key, list(loads))
    homes = homes or {}
    if cached is not None or homes:
        cached = cached or {}
        order.sort(key=lambda replica_id: (-homes.get(replica_id, NO_SLOT), -cached.get(replica_id, 0)))
        eps = eps if any(cached.values()) or max(homes.values(), default=NO_SLOT) >= HOLDS else 0.0
    bound = load_bound(sum(loads.values()), len(loads), eps)
    for replica_id in order:
        if loads[replica_id] + 1 <= bound:
            return Choice(replica_id, "affinity" if replica_id == order[0] else "spill")
    raise AssertionError("with eps >= 0 the least-loaded replica is always within the bound")


def choose_by_work(key: int | None, loads: Mapping[str, float], costs: Mapping[str, float], eps: float,
                   homes: Mapping[str, int] | None = None) -> Choice:
    """loads: every candidate replica's open work; costs: this request's work on each
    (less where its prefix is cached). The replicas in order of that cost, the key's
    rendezvous order among equals: a prefix stays where it is cached, even where a spill
    put it, rather than being computed again at its home. The first of them whose work,
    with this request, stays within (1 + eps) x the mean work with it; where none does
    (little in flight, or one request outweighing the rest), the one that would end with
    the least work, which always qualifies. homes: as choose's, ranked ahead of cost."""
    after = {replica_id: loads[replica_id] + costs[replica_id] for replica_id in loads}
    if key is None:
        return Choice(_least_loaded(after), "least_loaded")
    homes = homes or {}
    order = sorted(rendezvous_order(key, list(loads)),  # stable: rendezvous among equals
                   key=lambda replica_id: (-homes.get(replica_id, NO_SLOT), costs[replica_id]))
    total, least = sum(loads.values()), min(after.values())
    for replica_id in order:
        bound = (1 + eps) * (total + costs[replica_id]) / len(loads)
        if after[replica_id] <= max(bound, least):
            return Choice(replica_id, "affinity" if replica_id == order[0] else "spill")
    raise AssertionError("the replica that would end with the least work is always within the bound")


def request_work(num_prompt_tokens: int, num_cached_tokens: int, max_tokens: int, decode_token_cost: float) -> float:
    """What a request asks of a replica that holds num_cached_tokens of its prompt: the
    rest of the prompt to compute, and max_tokens to decode, each worth decode_token_cost
    prompt tokens (a decode step batches every running request, a prefill does not)."""
    return num_prompt_tokens - num_cached_tokens + decode_token_cost * max_tokens


def _least_loaded(loads: Mapping[str, float]) -> str:
    lowest = min(loads.values())
    return random.choice([replica_id for replica_id, load in loads.items() if load == lowest])
