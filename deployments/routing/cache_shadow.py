"""What each engine replica's prefix cache likely holds, as one router has seen it.

A router cannot ask a replica what it caches without waiting on it, so it keeps a shadow:
the block hashes (deployments/routing/prefix_routing.py block_hashes) of the prompts it sent to
each replica, least recently sent forgotten first once a replica's shadow holds as many
blocks as the replica's KV pool (as the engine evicts its least recently freed block).
What other routers sent is not in it: they differ in what they know, not in how they rank
replicas. No Ray here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Until a replica reports its pool size (routing stats), its shadow keeps this many blocks.
DEFAULT_NUM_BLOCKS = 4096


class CacheShadow:
    def __init__(self) -> None:
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def num_cached_blocks(self, replica_id: str, hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks the replica likely holds."""
        blocks = self._blocks.get(replica_id, {})
        num_cached = 0
        while num_cached < len(hashes) and hashes[num_cached] in blocks:
            num_cached += 1
        return num_cached

    def record(self, replica_id: str, hashes: Sequence[int], num_blocks: int = DEFAULT_NUM_BLOCKS) -> None:
        """A prompt sent to the replica: its blocks are the most recent there. Its first
        block is recorded last, so that a prompt's tail is forgotten before its head, as the
        engine frees a sequence's blocks in reverse."""
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        for block_hash in reversed(hashes):
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        while len(blocks) > num_blocks:
            blocks.popitem(last=False)

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone (a replica that comes back starts empty)."""
        keep = set(replica_ids)
        for replica_id in [r for r in self._blocks if r not in keep]:
            del self._blocks[replica_id]
