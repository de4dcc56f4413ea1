"""Paged KV blocks: allocation, ref counts and the prefix cache.

A block is in exactly one of three states:

    used          ref_count > 0, listed in the block tables of ref_count live sequences
    cached-free   ref_count == 0, still holds a full block of K/V keyed by its hash;
                  a later prompt with the same prefix can take it back (a hit)
    free          ref_count == 0, no hash

Free and cached-free blocks share one LRU queue; allocation takes the least recently freed
block, evicting its hash. Freeing is the mirror image of allocating: a sequence's blocks
go back in reverse order, so its tail is evicted before its (more shareable) head.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


# Stands in for "no previous block": hash(None) differs between Python 3.11 processes,
# while a tuple of ints hashes the same in every process, so routers in other processes
# compute the very keys this engine caches under (deployments/routing/prefix_routing.py).
_FIRST_BLOCK_PREV_HASH = 0x5EED


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A full block's key: its tokens and, through prev_hash, every token before it.
    The same in every process (no per-process hash salt), so other processes can compute it.
    A first block's prev_hash is its sequence's cache_salt: None for the base model, a LoRA adapter's digest
    (engine/lora/adapter.py) otherwise, so that adapters never share blocks."""
    return hash((_FIRST_BLOCK_PREV_HASH if prev_hash is None else prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(self.num_prefix_queried_tokens, 1)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def num_new_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(seq.num_blocks_for(num_tokens) - seq.num_blocks, 0)

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached blocks of its longest cached prefix.

        Returns the number of tokens covered. The last token is always left to compute:
        its logits are what the sequence samples from. A sequence still scoring its prompt
        (prompt_logprobs) takes no cached blocks: a hit would skip the forward that yields
        those positions' logits (vLLM does the same). It still shares its blocks once computed.
        """
        assert not seq.block_table, "prefix lookup is for sequences holding no blocks"
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return 0
        prev_hash = seq.cache_salt
        for index in range((seq.num_tokens - 1) // self.block_size):
            token_ids = tuple(seq.block_tokens(index))
            prev_hash = chain_hash(prev_hash, token_ids)
            block_id = self.hash_to_block_id.get(prev_hash)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(prev_hash)
        return seq.num_blocks * self.block_size

    def prompt_hashes(self, seq: Sequence) -> list[int]:
        """The keys of the prompt's full blocks that a lookup would try (the last token's
        block never), first block first; kept on the sequence after the first call."""
        if seq.prompt_hashes is None:
            hashes: list[int] = []
            for index in range((seq.num_prompt_tokens - 1) // self.block_size):
                hashes.append(chain_hash(hashes[-1] if hashes else seq.cache_salt, tuple(seq.block_tokens(index))))
            seq.prompt_hashes = hashes
        return seq.prompt_hashes

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queried_tokens += num_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def reset_prefix_stats(self) -> None:
        self.num_prefix_queried_tokens = self.num_prefix_hit_tokens = 0

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold num_tokens tokens."""
        num_needed = self.num_new_blocks_needed(seq, num_tokens)
        assert self.can_allocate(num_needed), "caller must check can_allocate first"
        for _ in range(num_needed):
            block_id, _ = self.free_block_ids.popitem(last=False)
            self._evict_hash(self.blocks[block_id])
            self._take(block_id)
            seq.block_table.append(block_id)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink seq's block table to what num_tokens tokens need: the blocks allocated for
        rejected proposals go back. They were never keyed (only computed tokens' full blocks
        are), so they go to the front of the queue, as free() puts unkeyed blocks."""
        while seq.num_blocks > seq.num_blocks_for(num_tokens):
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None, "a trimmed block is seq's own and unkeyed"
            block.ref_count = 0
            self.free_block_ids[block.block_id] = None
            self.free_block_ids.move_to_end(block.block_id, last=False)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.hash is None:  # nothing worth keeping: reuse it first
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Key every block seq has completely computed, so later prompts can share it. A
        computed proposal is not one of seq's tokens until it is accepted and appended."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for index in range(len(seq.block_hashes), num_full):
            token_ids = tuple(seq.block_tokens(index))
            prev_hash = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            block_hash = chain_hash(prev_hash, token_ids)
            block = self.blocks[seq.block_table[index]]
            block.hash, block.token_ids = block_hash, token_ids
            self.hash_to_block_id.setdefault(block_hash, block.block_id)
            seq.block_hashes.append(block_hash)

    def check_integrity(self, live_seqs: list[Sequence]) -> None:
        """Assert the pool's invariants; cheap enough to call whenever the engine is idle."""
        refs = [0] * self.num_blocks
        for seq in live_seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref count drift"
            assert (block.ref_count == 0) == (block.block_id in self.free_block_ids)
        assert self.num_free_blocks + sum(r > 0 for r in refs) == self.num_blocks
        for block_hash, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].hash == block_hash, f"stale hash entry for block {block_id}"

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_block_ids.pop(block_id, None)
        block.ref_count += 1

    def _evict_hash(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = None, ()
