"""The KV block pool: allocate and free are mirror images, prefix blocks are shared by ref
count, cached free blocks are evicted least-recently-freed first, and the integrity check
catches drift."""

from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.request.sampling_params import SamplingParams
from engine.core.sequence import Sequence

BLOCK = 4


def seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(), BLOCK)


def computed(manager: BlockManager, s: Sequence) -> Sequence:
    """Allocate s whole and mark it computed, as a finished prefill would."""
    manager.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    manager.commit_full_blocks(s)
    return s


def test_allocate_then_free_returns_the_pool_to_where_it_was():
    manager = BlockManager(8, BLOCK)
    s = seq(list(range(10)))
    manager.allocate(s, 10)
    assert s.num_blocks == 3 and manager.num_free_blocks == 5
    manager.check_integrity([s])
    manager.free(s)
    assert s.block_table == [] and manager.num_free_blocks == 8
    manager.check_integrity([])


def test_a_shared_prefix_is_one_set_of_blocks_with_ref_counts():
    manager = BlockManager(8, BLOCK)
    first = computed(manager, seq(list(range(9)), "a"))
    second = seq(list(range(8)) + [99, 100], "b")
    assert manager.allocate_cached_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [manager.blocks[b].ref_count for b in second.block_table] == [2, 2]
    manager.check_integrity([first, second])
    manager.free(first)
    manager.free(second)
    manager.check_integrity([])


def test_the_last_prompt_token_is_never_served_from_cache():
    manager = BlockManager(8, BLOCK)
    computed(manager, seq(list(range(8)), "a"))
    again = seq(list(range(8)), "b")
    assert manager.allocate_cached_prefix(again) == 4  # block 2 holds the token to sample from


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    manager = BlockManager(4, BLOCK)
    old = computed(manager, seq(list(range(4)) + [50], "old"))
    manager.free(old)
    new = computed(manager, seq(list(range(100, 104)) + [60], "new"))
    manager.free(new)
    # Two cached blocks (old's, then new's) and two plain free ones; the plain ones go first.
    filler = seq(list(range(200, 208)), "filler")
    manager.allocate(filler, 8)
    reuse = seq(list(range(4)) + [1], "x")
    assert manager.allocate_cached_prefix(reuse) == 4
    manager.free(reuse)  # old's block, freed again: now new's is the least recently freed
    manager.allocate(seq(list(range(300, 304)), "one-more"), 4)  # only cached blocks are left: one goes
    assert manager.allocate_cached_prefix(seq(list(range(100, 104)) + [1], "y")) == 0  # new's was evicted
    assert manager.allocate_cached_prefix(seq(list(range(4)) + [1], "z")) == 4  # old's was kept


def test_evicting_a_cached_block_forgets_its_hash():
    manager = BlockManager(2, BLOCK)
    old = computed(manager, seq(list(range(4)) + [50], "old"))
    manager.free(old)
    hog = seq(list(range(300, 308)), "hog")
    manager.allocate(hog, 8)
    assert manager.hash_to_block_id == {}
    manager.free(hog)
    assert manager.allocate_cached_prefix(seq(list(range(4)) + [1], "x")) == 0


def test_integrity_check_catches_a_ref_count_drift():
    manager = BlockManager(4, BLOCK)
    s = seq(list(range(4)))
    manager.allocate(s, 4)
    manager.blocks[s.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref count"):
        manager.check_integrity([s])
