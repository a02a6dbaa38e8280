"""BlockPool free list, per-group block policies and the KVCacheManager coordinator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from attnplug.cache_groups.block_pool import (
    BlockPool,
    FullAttentionManager,
    KVCacheManager,
    MambaStateManager,
    SlidingWindowManager,
    make_block_manager,
)
from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import KVCacheSpecError, SchedulingError


@dataclass
class Req:
    req_id: str
    num_computed_tokens: int = 0


def kv_config(num_blocks, *specs):
    return KVCacheConfig(num_blocks, tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)))


# --- BlockPool ------------------------------------------------------------------------------
def test_fresh_pool_hands_out_ids_in_order_and_never_the_null_block():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5 and pool.capacity == 5
    ids = pool.allocate(5)
    assert ids == [1, 2, 3, 4, 5]
    assert NULL_BLOCK_ID not in ids
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 5


def test_free_list_is_fifo():
    pool = BlockPool(6)
    a = pool.allocate(3)
    pool.free([a[2], a[0]])
    assert pool.allocate(4) == [4, 5, 3, 1]


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(SchedulingError, match="1 of 3 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 2
    assert pool.allocate(0) == []


def test_free_ignores_null_and_detects_double_free_without_side_effects():
    pool = BlockPool(5)
    ids = pool.allocate(3)
    pool.free([NULL_BLOCK_ID])
    assert pool.num_free_blocks == 1
    pool.free([ids[0]])
    with pytest.raises(SchedulingError, match="double free of block 1"):
        pool.free([ids[1], ids[0]])
    assert pool.is_allocated(ids[1])  # the valid id in the failed call was not freed
    with pytest.raises(SchedulingError, match="twice"):
        pool.free([ids[1], ids[1]])
    with pytest.raises(SchedulingError, match="ids of this pool"):
        pool.free([5])
    assert pool.num_used_blocks == 2


def test_peak_usage_tracks_maximum():
    pool = BlockPool(10)
    a = pool.allocate(4)
    pool.free(a)
    pool.allocate(2)
    assert pool.peak_num_used_blocks == 4
    pool.reset_peak()
    assert pool.peak_num_used_blocks == 2


@pytest.mark.parametrize("n", [0, 1, -3])
def test_pool_needs_two_blocks(n):
    with pytest.raises(KVCacheSpecError, match="null block"):
        BlockPool(n)


# --- per-group policies -------------------------------------------------------------------
def test_make_block_manager_dispatches_on_spec():
    pool = BlockPool(4)
    assert type(make_block_manager(FullAttentionSpec(block_size=4), pool)) is FullAttentionManager
    assert type(make_block_manager(SlidingWindowSpec(block_size=4, sliding_window=8), pool)) is SlidingWindowManager
    assert type(make_block_manager(MambaSpec(block_size=64), pool)) is MambaStateManager
    with pytest.raises(KVCacheSpecError, match="no block policy"):
        make_block_manager(KVCacheSpec(block_size=4), pool)


def test_full_attention_needs_cdiv_blocks():
    m = FullAttentionManager(FullAttentionSpec(block_size=4), BlockPool(16))
    assert [m.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert m.allocate_new_blocks("r", 5) == [1, 2]
    assert m.allocate_new_blocks("r", 8) == []
    assert m.allocate_new_blocks("r", 9) == [3]
    assert m.block_ids("r") == [1, 2, 3]
    m.free("r")
    assert m.pool.num_used_blocks == 0 and m.block_ids("r") == []


def test_sliding_window_frees_invisible_blocks_without_shifting():
    W, B = 6, 4
    m = SlidingWindowManager(SlidingWindowSpec(block_size=B, sliding_window=W), BlockPool(32))
    m.allocate_new_blocks("r", 12)           # blocks for tokens 0..11
    assert m.block_ids("r") == [1, 2, 3]
    # after 9 computed tokens the next query (pos 9) sees keys 4..9: tokens 0..3 skippable
    assert m.num_reclaimable_blocks("r", 9) == 1
    m.remove_skipped_blocks("r", 9)
    assert m.block_ids("r") == [NULL_BLOCK_ID, 2, 3]
    assert not m.pool.is_allocated(1)
    m.remove_skipped_blocks("r", 9)          # idempotent
    m.remove_skipped_blocks("r", 13)         # tokens 0..7 skippable -> logical block 1 too
    assert m.block_ids("r") == [NULL_BLOCK_ID, NULL_BLOCK_ID, 3]
    m.free("r")
    assert m.pool.num_used_blocks == 0


def test_sliding_window_peak_per_request_within_bound_on_long_request():
    W, B, budget = 10, 4, 6
    m = SlidingWindowManager(SlidingWindowSpec(block_size=B, sliding_window=W), BlockPool(128))
    bound = cdiv(W - 1 + budget, B) + 1
    assert m.max_blocks_per_request(400, budget) == bound
    computed, peak = 0, 0
    while computed < 400:
        n = min(budget, 400 - computed)
        m.remove_skipped_blocks("r", computed)
        m.allocate_new_blocks("r", computed + n)
        live = [b for b in m.block_ids("r") if b != NULL_BLOCK_ID]
        peak = max(peak, len(live))
        computed += n
    assert len(m.block_ids("r")) == cdiv(400, B)
    assert peak <= bound


def test_mamba_state_is_one_slot_whatever_the_length():
    m = MambaStateManager(MambaSpec(block_size=1024), BlockPool(4))
    assert m.allocate_new_blocks("r", 7) == [1]
    assert m.allocate_new_blocks("r", 900) == []
    assert m.max_blocks_per_request(5000, 64) == 1


# --- KVCacheManager -------------------------------------------------------------------------
def test_allocate_slots_per_group_block_sizes():
    kv = KVCacheManager(kv_config(16, FullAttentionSpec(block_size=4), FullAttentionSpec(block_size=8)))
    r = Req("a")
    assert kv.allocate_slots(r, 9) == ([1, 2, 3], [1, 2])
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 1) == ([], [])
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 7) == ([4, 5], [3])
    assert kv.get_block_ids("a") == ([1, 2, 3, 4, 5], [1, 2, 3])
    kv.free(r)
    assert kv.num_used_blocks_per_group == [0, 0]
    assert kv.peak_blocks_per_group == [5, 3]


def test_allocate_slots_is_all_or_nothing_across_groups():
    # group 0 (block 2) would need 5 blocks but has 4; group 1 (block 8) would fit.
    kv = KVCacheManager(kv_config(5, FullAttentionSpec(block_size=2), FullAttentionSpec(block_size=8)))
    r = Req("a")
    assert not kv.can_allocate(r, 9)
    assert kv.allocate_slots(r, 9) is None
    assert kv.num_used_blocks_per_group == [0, 0]
    assert kv.allocate_slots(r, 8) == ([1, 2, 3, 4], [1])


def test_can_allocate_counts_blocks_the_window_gives_back():
    kv = KVCacheManager(kv_config(4, SlidingWindowSpec(block_size=4, sliding_window=4)))
    r = Req("a")
    assert kv.allocate_slots(r, 12) == ([1, 2, 3],)
    r.num_computed_tokens = 12                      # tokens 0..8 skippable: blocks 0, 1
    assert kv.num_free_blocks_per_group == [0]
    assert kv.can_allocate(r, 8)
    assert kv.allocate_slots(r, 8) == ([1, 2],)
    assert kv.get_block_ids("a") == ([NULL_BLOCK_ID, NULL_BLOCK_ID, 3, 1, 2],)


def test_negative_new_tokens_rejected():
    kv = KVCacheManager(kv_config(4, FullAttentionSpec(block_size=4)))
    with pytest.raises(SchedulingError, match=">= 0"):
        kv.allocate_slots(Req("a"), -1)
