"""Edges of the prefix-caching pool (cache_groups/prefix_cache.py) and of the hybrid hit
rules (cache_groups/hybrid_hits.py): counters, block size 1, exact refusals (each message
written out in full, so a refusal that lost or changed its words fails)."""

from __future__ import annotations

import hashlib

import pytest

from attnplug.cache_groups.block_hash import hash_request_tokens
from attnplug.cache_groups.hybrid_hits import (
    HybridPrefixCoordinator,
    find_longest_cache_hit,
    group_hit,
    mamba_hit,
    sliding_window_hit,
)
from attnplug.cache_groups.prefix_cache import KVCacheBlock, PrefixCachingBlockPool
from attnplug.cache_groups.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from attnplug.core.errors import KVCacheSpecError, SchedulingError


def H(i: int) -> bytes:
    return hashlib.sha256(b"edge%d" % i).digest()


def refused(exc, call, msg):
    with pytest.raises(exc) as e:
        call()
    assert str(e.value) == msg


# --- the pool -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [1, 0, True, 2.0, "4"])
def test_pool_size_refusal(bad):
    refused(KVCacheSpecError, lambda: PrefixCachingBlockPool(bad),
            f"a block pool needs num_blocks >= 2 (block 0 is the reserved null block), got {bad!r}; "
            "raise --num-blocks")


def test_a_new_pool_of_two_blocks():
    p = PrefixCachingBlockPool(2)
    assert (p.num_free_blocks, p.num_used_blocks, p.peak_num_used_blocks, p.capacity) == (1, 0, 0, 1)
    assert (p.num_cached_blocks, p.num_evictions) == (0, 0)
    assert p.allocate(0) == [] and p.peak_num_used_blocks == 0
    assert p.allocate(1) == [1] and p.peak_num_used_blocks == 1
    assert repr(p.blocks[1]) == "KVCacheBlock(id=1, ref_cnt=1, hash=None)"
    b = KVCacheBlock(5)
    b.block_hash = bytes(range(32))
    assert repr(b) == "KVCacheBlock(id=5, ref_cnt=0, hash=00010203)"


def test_allocate_refusal_names_the_counts_and_the_remedy():
    p = PrefixCachingBlockPool(4)
    p.allocate(1)
    for n in (3, -1):
        refused(SchedulingError, lambda: p.allocate(n),
                f"cannot allocate {n} blocks: 2 of 3 are free; check num_free_blocks (or use "
                "KVCacheManager.allocate_slots, which returns None when short) before allocating")
    assert p.allocate(2) == [2, 3]  # exactly what is free
    p.free([2, 3])
    for n in (True, 1.0, "1"):
        refused(SchedulingError, lambda: p.allocate(n),
                f"cannot allocate {n} blocks: 2 of 3 are free; check num_free_blocks (or use "
                "KVCacheManager.allocate_slots, which returns None when short) before allocating")
    assert p.num_free_blocks == 2


def test_free_and_touch_refusals():
    p = PrefixCachingBlockPool(4)
    a = p.allocate(2)  # [1, 2]
    refused(SchedulingError, lambda: p.free([1, 9]), "cannot free block 9: ids of this pool are 1..3")
    refused(SchedulingError, lambda: p.free([2, 2]),
            "block ids [2, 2] list a block twice; each block is freed once per call")
    refused(SchedulingError, lambda: p.free([1, 3]),
            "double free of block 3: it is not allocated; a request's blocks must be freed exactly once")
    refused(SchedulingError, lambda: p.touch([4]), "cannot touch block 4: ids of this pool are 1..3")
    refused(SchedulingError, lambda: p.touch([1, 1]),
            "block ids [1, 1] list a block twice; each block is touchd once per call")
    refused(SchedulingError, lambda: p.touch([3]),
            "cannot touch block 3: it is free and not cached, so it holds no prefix; "
            "touch only ids returned by get_cached_block")
    assert [p.blocks[i].ref_cnt for i in range(4)] == [0, 1, 1, 0]  # nothing changed
    p.free([0, a[1], 0, a[0]])  # null entries are ignored
    assert p.num_used_blocks == 0 and p.num_free_blocks == 3


def test_cache_full_blocks_refusals():
    p = PrefixCachingBlockPool(5)
    a = p.allocate(2)
    refused(SchedulingError, lambda: p.cache_full_blocks(a, [H(0), H(1)], 0, 3),
            "cache_full_blocks: need 0 <= num_cached_blocks (0) <= num_full_blocks (3) "
            "<= blocks (2) and hashes (2)")
    refused(SchedulingError, lambda: p.cache_full_blocks(a, [H(0), H(1)], 2, 1),
            "cache_full_blocks: need 0 <= num_cached_blocks (2) <= num_full_blocks (1) "
            "<= blocks (2) and hashes (2)")
    refused(SchedulingError, lambda: p.cache_full_blocks([1, 3], [H(0), H(1)], 0, 2),
            "cache_full_blocks: block 3 (logical 1) is not held by a request")
    refused(SchedulingError, lambda: p.cache_full_blocks([1, 7], [H(0), H(1)], 0, 2),
            "cache_full_blocks: block 7 (logical 1) is not held by a request")
    assert p.num_cached_blocks == 0
    assert p.cache_full_blocks(a, [H(0), H(1)], 0, 2) == 2
    assert p.cache_full_blocks(a, [H(0), H(1)], 0, 2) == 0  # the same hashes again: nothing new
    refused(SchedulingError, lambda: p.cache_full_blocks(a, [H(0), H(9)], 0, 2),
            "cache_full_blocks: block 2 (logical 1) is cached under another hash; "
            "a block's contents never change while it is held")
    assert p.cache_full_blocks(a, [H(0), H(1)], 2, 2) == 0  # an empty range
    refused(SchedulingError, lambda: p.cache_full_blocks([5], [H(5)], 0, 1),
            "cache_full_blocks: block 5 (logical 0) is not held by a request")  # exactly num_blocks


def test_cache_full_blocks_registers_only_its_range_and_skips_null_entries():
    p = PrefixCachingBlockPool(6)
    a = p.allocate(3)  # [1, 2, 3]
    assert p.cache_full_blocks(a, [H(0), H(1), H(2)], 1, 2) == 1  # logical block 1 only
    assert p.get_cached_block(H(0)) is None and p.get_cached_block(H(1)) == 2
    assert p.get_cached_block(H(2)) is None
    # a sliding window gave logical block 0 back: the null entry is skipped, the rest cached
    assert p.cache_full_blocks([0, a[0], a[2]], [H(7), H(8), H(9)], 0, 3) == 2
    assert p.get_cached_block(H(7)) is None and p.get_cached_block(H(8)) == 1 and p.get_cached_block(H(9)) == 3


def test_evictions_are_counted_one_by_one_and_a_reset_counts_none():
    p = PrefixCachingBlockPool(4)
    a = p.allocate(3)
    assert p.cache_full_blocks(a, [H(0), H(1), H(2)], 0, 3) == 3
    p.free(reversed(a))  # LRU order: 3, 2, 1
    assert p.num_free_blocks == 3 and p.num_cached_blocks == 3
    assert p.allocate(1) == [3] and p.num_evictions == 1
    assert p.allocate(1) == [2] and p.num_evictions == 2
    assert p.get_cached_block(H(2)) is None and p.get_cached_block(H(1)) is None
    assert p.get_cached_block(H(0)) == 1
    assert p.reset_prefix_cache() == 1
    assert p.num_evictions == 2 and p.num_cached_blocks == 0 and p.get_cached_block(H(0)) is None
    assert p.allocate(1) == [1] and p.num_evictions == 2  # hashless now: no eviction
    assert p.reset_prefix_cache() == 0


def test_reset_keeps_held_hashes_and_moves_free_ones_to_the_fifo_tier_lru_first():
    p = PrefixCachingBlockPool(6)
    a = p.allocate(5)
    p.cache_full_blocks(a, [H(i) for i in range(5)], 0, 5)
    p.free([a[3], a[1], a[4]])  # LRU: 4, 2, 5
    assert p.reset_prefix_cache() == 3
    assert p.num_cached_blocks == 2 and p.get_cached_block(H(0)) == 1 and p.get_cached_block(H(2)) == 3
    assert p.allocate(3) == [4, 2, 5] and p.num_evictions == 0


def test_touch_and_peak_counters():
    p = PrefixCachingBlockPool(5)
    a = p.allocate(2)
    p.cache_full_blocks(a, [H(0), H(1)], 0, 2)
    p.free(a)
    p.reset_peak()
    assert p.peak_num_used_blocks == 0 and p.num_used_blocks == 0
    p.touch([0, a[0], 0])  # a prefix hit: block 1 leaves the free queue
    assert p.num_used_blocks == 1 and p.peak_num_used_blocks == 1 and p.num_free_blocks == 3
    p.touch([a[0]])  # a second holder: counted once
    assert p.blocks[a[0]].ref_cnt == 2 and p.num_used_blocks == 1
    assert p.allocate(3) == [3, 4, 2] and p.num_evictions == 1  # 2 was the only cached free block
    assert p.peak_num_used_blocks == 4
    p.free([a[0]])
    assert p.is_allocated(a[0]) and p.num_used_blocks == 4


# --- hit rules ------------------------------------------------------------------------------
def test_block_size_one_and_the_bounds_of_the_window_rule():
    assert sliding_window_hit([5, 6, 7], 3, 2, 1) == [0, 0, 7]
    assert sliding_window_hit([5, 6, 7], 3, 3, 1) == [0, 6, 7]
    assert sliding_window_hit([5, None, 7], 2, 1, 1) == [0, 0]  # W == 1 needs nothing
    assert sliding_window_hit([None, None], 2, 2, 1) == []
    for W, B in ((0, 4), (4, 0), (-1, 1)):
        refused(KVCacheSpecError, lambda: sliding_window_hit([1], 1, W, B),
                f"sliding_window ({W}) and block_size ({B}) must be >= 1")


def test_mamba_hit_at_block_size_one():
    assert mamba_hit([None, 4, None], 3) == [0, 4]


def test_hit_rule_refusals():
    refused(KVCacheSpecError, lambda: group_hit(KVCacheSpec(block_size=4), [1], 1),
            "no prefix-cache hit rule for KVCacheSpec; supported: FullAttentionSpec, SlidingWindowSpec, StateSpec")
    full = FullAttentionSpec(block_size=4)
    refused(KVCacheSpecError, lambda: find_longest_cache_hit([full], [[1], [2]], 4), "1 specs for 2 groups' lookups")
    refused(KVCacheSpecError, lambda: find_longest_cache_hit([], [], 4), "0 specs for 0 groups' lookups")
    refused(SchedulingError, lambda: find_longest_cache_hit([full], [[1]], -1), "max_length must be >= 0, got -1")
    pool = PrefixCachingBlockPool(4)
    refused(KVCacheSpecError, lambda: HybridPrefixCoordinator([full], [pool, pool]), "1 specs for 2 pools")
    refused(KVCacheSpecError, lambda: HybridPrefixCoordinator([], []), "0 specs for 0 pools")
    coord = HybridPrefixCoordinator([full], [pool])
    refused(SchedulingError, lambda: coord.get_computed_blocks([]),
            "get_computed_blocks: a request has at least one token")


def test_given_block_hashes_are_used_instead_of_hashing_again(monkeypatch):
    full, win = FullAttentionSpec(block_size=2), SlidingWindowSpec(block_size=1, sliding_window=2)
    pools = [PrefixCachingBlockPool(8), PrefixCachingBlockPool(8)]
    coord = HybridPrefixCoordinator([full, win], pools)
    tokens = [3, 1, 4, 1, 5]
    hashes = coord.block_hashes(tokens, "salt")
    assert hashes == {1: hash_request_tokens(tokens, 1, "salt"), 2: hash_request_tokens(tokens, 2, "salt")}
    for s, p in zip(coord.specs, pools):
        ids = p.allocate(len(tokens) // s.block_size)
        p.cache_full_blocks(ids, hashes[s.block_size], 0, len(ids))
    expected = coord.get_computed_blocks(tokens, "salt")
    assert expected.num_computed_tokens == 4
    assert expected.block_ids == ((1, 2), (0, 0, 0, 4))  # W = 2 reads one block back

    def no_hashing(*a, **k):
        raise AssertionError("hashed again although block_hashes was given")

    monkeypatch.setattr(coord, "block_hashes", no_hashing)
    assert coord.get_computed_blocks(tokens, "salt", block_hashes=hashes) == expected
