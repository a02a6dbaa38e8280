"""BlockPool and the block policies at the edges mutation testing found untested: each
refusal's exact message, the boundaries of every count check (a pool of exactly two blocks,
an allocation of exactly the free blocks, a manager short by exactly what the window gives
back), and the per-group views of KVCacheManager. Module-level: no ATTNPLUG_VALIDATE."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
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
from attnplug.cache_groups.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import KVCacheSpecError, SchedulingError


@pytest.fixture(autouse=True)
def _no_validate(monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)


@dataclass
class Req:
    req_id: str
    num_computed_tokens: int = 0


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize("n", [1, 0, 2.0, None])
def test_a_pool_needs_two_int_blocks(n):
    with pytest.raises(KVCacheSpecError, match=exactly(
            f"a block pool needs num_blocks >= 2 (block 0 is the reserved null block), got {n!r}; raise --num-blocks")):
        BlockPool(n)


def test_the_smallest_pool_has_one_block():
    pool = BlockPool(2)
    assert (pool.capacity, pool.num_free_blocks, pool.num_used_blocks, pool.peak_num_used_blocks) == (1, 1, 0, 0)
    assert pool.allocate(1) == [1]  # exactly all the free blocks
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.peak_num_used_blocks) == (0, 1, 1)
    assert pool.is_allocated(1) is True and pool.is_allocated(0) is False
    pool.free(np.array([1]))  # numpy ids too
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.peak_num_used_blocks) == (1, 0, 1)
    assert pool.is_allocated(1) is False


@pytest.mark.parametrize("n, free", [(-1, 3), (4, 3), (1, 0)])
def test_allocate_refuses_with_the_counts(n, free):
    pool = BlockPool(4)
    pool.allocate(3 - free)
    with pytest.raises(SchedulingError, match=exactly(
            f"cannot allocate {n} blocks: {free} of 3 are free; check num_free_blocks (or use "
            "KVCacheManager.allocate_slots, which returns None when short) before allocating")):
        pool.allocate(n)
    assert pool.num_free_blocks == free and pool.num_used_blocks == 3 - free


def test_free_refuses_with_the_block_and_frees_nothing():
    pool = BlockPool(5)
    ids = pool.allocate(3)
    for bad in (-1, 5, 9):
        with pytest.raises(SchedulingError, match=exactly(f"cannot free block {bad}: ids of this pool are 1..4")):
            pool.free([ids[0], bad])
    with pytest.raises(SchedulingError, match=exactly(
            "double free of block 4: it is not allocated; a request's blocks must be freed exactly once")):
        pool.free([ids[0], 4])  # the pool's last id is in range, but not allocated
    with pytest.raises(SchedulingError, match=exactly(
            f"block ids {[ids[1], ids[1]]} list a block twice; each block is freed once")):
        pool.free([ids[1], ids[1]])
    assert all(pool.is_allocated(b) for b in ids) and pool.num_used_blocks == 3 and pool.num_free_blocks == 1
    pool.free([])  # nothing
    pool.free(iter([NULL_BLOCK_ID, ids[2], NULL_BLOCK_ID, ids[0]]))  # any iterable, nulls skipped, order kept
    assert pool.num_used_blocks == 1 and pool.allocate(3) == [4, ids[2], ids[0]]


def test_peak_is_reset_to_the_current_use():
    pool = BlockPool(8)
    a = pool.allocate(5)
    pool.free(a[:3])
    assert pool.peak_num_used_blocks == 5
    pool.reset_peak()
    assert pool.peak_num_used_blocks == 2
    pool.allocate(1)
    assert pool.peak_num_used_blocks == 3
    pool.free(a[3:])
    assert pool.peak_num_used_blocks == 3 and pool.num_used_blocks == 1


def test_each_policy_draws_from_the_pool_it_is_given():
    for spec in (FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=4, sliding_window=8),
                 MambaSpec(block_size=64)):
        pool = BlockPool(4)
        m = make_block_manager(spec, pool)
        assert m.pool is pool and m.spec is spec and m.block_size == spec.block_size
        assert m.allocate_new_blocks("r", 1) == [1] and pool.num_used_blocks == 1


def test_no_block_policy_message():
    with pytest.raises(KVCacheSpecError, match=exactly(
            "no block policy for KVCacheSpec; supported: FullAttentionSpec, SlidingWindowSpec, StateSpec")):
        make_block_manager(KVCacheSpec(block_size=4), BlockPool(4))


def test_a_request_shrinking_allocates_nothing_and_keeps_its_blocks():
    m = FullAttentionManager(FullAttentionSpec(block_size=4), BlockPool(8))
    assert m.allocate_new_blocks("r", 9) == [1, 2, 3]
    assert m.get_num_blocks_to_allocate("r", 2) == 0 and m.allocate_new_blocks("r", 2) == []
    assert m.block_ids("r") == [1, 2, 3] and m.max_blocks_per_request(9, 1) == 3
    m.free("r")
    m.free("r")  # no-op the second time
    assert m.pool.num_used_blocks == 0 and m.pool.allocate(3) == [4, 5, 6]


def test_mamba_state_needs_a_slot_only_once_it_holds_tokens():
    m = MambaStateManager(MambaSpec(block_size=16), BlockPool(4))
    assert [m.num_blocks_needed(n) for n in (0, 1, 2, 10_000)] == [0, 1, 1, 1]
    assert m.allocate_new_blocks("r", 0) == [] and m.block_ids("r") == []


def test_window_policy_at_its_edges():
    B, W = 4, 5
    m = SlidingWindowManager(SlidingWindowSpec(block_size=B, sliding_window=W), BlockPool(16))
    m.allocate_new_blocks("r", 8)  # two blocks
    # n = 20: 16 tokens skippable = 4 blocks, but the request holds only 2: both go, nothing else
    assert m.num_reclaimable_blocks("r", 20) == 2
    m.remove_skipped_blocks("r", 20)
    assert m.block_ids("r") == [NULL_BLOCK_ID, NULL_BLOCK_ID] and m.pool.num_used_blocks == 0
    assert m.num_reclaimable_blocks("unknown", 20) == 0
    m.remove_skipped_blocks("unknown", 20)  # a request without blocks: nothing to do
    # the window bound, and the request's own length when that is smaller
    assert m.max_blocks_per_request(1000, 4) == -(-(W - 1 + 4) // B) + 1 == 3
    assert m.max_blocks_per_request(5, 4) == 2


def test_window_frees_the_blocks_front_to_back_into_the_pool():
    m = SlidingWindowManager(SlidingWindowSpec(block_size=2, sliding_window=3), BlockPool(16))
    m.allocate_new_blocks("r", 10)  # [1, 2, 3, 4, 5]
    m.remove_skipped_blocks("r", 9)  # 7 tokens skippable: blocks 0..2
    assert m.block_ids("r") == [0, 0, 0, 4, 5]
    assert m.pool.allocate(m.pool.num_free_blocks)[-3:] == [1, 2, 3]  # freed in logical order


def _two_groups(num_blocks):
    return KVCacheManager(KVCacheConfig(num_blocks, (
        KVCacheGroupSpec(("l0",), FullAttentionSpec(block_size=8)),
        KVCacheGroupSpec(("l1",), SlidingWindowSpec(block_size=4, sliding_window=4)))))


def test_manager_views_per_group():
    kv = _two_groups(6)
    assert kv.num_groups == 2 and kv.capacity_per_group == [5, 5]
    r = Req("a")
    assert kv.allocate_slots(r, 16) == ([1, 2], [1, 2, 3, 4])
    assert kv.num_free_blocks_per_group == [3, 1] and kv.num_used_blocks_per_group == [2, 4]
    assert kv.max_blocks_per_request(40, 4) == [5, 3]
    kv.free("a")  # by id
    assert kv.num_used_blocks_per_group == [0, 0] and kv.peak_blocks_per_group == [2, 4]
    assert kv.get_block_ids("a") == ([], [])


def test_can_allocate_when_the_window_gives_back_exactly_what_is_missing():
    kv = _two_groups(6)
    r = Req("a")
    kv.allocate_slots(r, 16)
    r.num_computed_tokens = 16  # the window group: 13 tokens skippable = 3 blocks back, 1 free
    assert kv.can_allocate(r, 16)  # needs 4 more = 1 free + 3 given back; the full group needs 2 of 3
    assert not kv.can_allocate(r, 17)  # 5 more
    assert kv.allocate_slots(r, 17) is None and kv.num_used_blocks_per_group == [2, 4]
    assert kv.allocate_slots(r, 16) == ([3, 4], [5, 1, 2, 3])
    with pytest.raises(SchedulingError, match=exactly("request 'a': num_new_tokens must be >= 0, got -1")):
        kv.can_allocate(r, -1)
    assert kv.can_allocate(r, 0) and kv.allocate_slots(r, 0) == ([], [])


def test_mamba_groups_get_the_state_slot_pool():
    config = KVCacheConfig(10, (KVCacheGroupSpec(("attn",), FullAttentionSpec(block_size=4)),
                                KVCacheGroupSpec(("ssm",), MambaSpec(block_size=64))), num_state_slots=3)
    kv = KVCacheManager(config)
    assert kv.kv_cache_config is config and kv.capacity_per_group == [9, 2]
    assert kv.allocate_slots(Req("a"), 9) == ([1, 2, 3], [1])
    assert kv.allocate_slots(Req("b"), 1) == ([4], [2])
    assert not kv.can_allocate(Req("c"), 1)  # no state slot left
