"""Block hashes (cache_groups/block_hash.py) and the prefix-caching pool (cache_groups/prefix_cache.py)."""

from __future__ import annotations

import hashlib
from collections import deque

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from attnplug.cache_groups.block_hash import hash_block_tokens, hash_request_tokens
from attnplug.cache_groups.block_pool import BlockPool, SlidingWindowManager
from attnplug.cache_groups.prefix_cache import PrefixCachingBlockPool
from attnplug.cache_groups.specs import SlidingWindowSpec
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import KVCacheSpecError, SchedulingError

tokens_st = st.lists(st.integers(0, 50), min_size=0, max_size=24)
salt_st = st.one_of(st.none(), st.text(max_size=3), st.binary(max_size=3))


# --- hashing ------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(tokens_st, st.integers(1, 5), salt_st)
def test_same_tokens_and_salt_give_the_same_chain_and_it_is_incremental(toks, b, salt):
    chain = hash_request_tokens(toks, b, salt)
    assert len(chain) == len(toks) // b
    assert chain == hash_request_tokens(list(toks), b, salt)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in chain)
    # a prefix's chain is a prefix of the chain; continuing from it gives the same result
    k = len(chain) // 2
    head = hash_request_tokens(toks[:k * b], b, salt)
    assert head == chain[:k]
    assert hash_request_tokens(toks, b, salt, prev_block_hashes=head) == chain


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=24), st.integers(1, 5), salt_st, st.data())
def test_changing_one_token_changes_that_block_and_every_later_one(toks, b, salt, data):
    assume(len(toks) >= b)
    i = data.draw(st.integers(0, (len(toks) // b) * b - 1))
    other = list(toks)
    other[i] = toks[i] + 1
    a, c = hash_request_tokens(toks, b, salt), hash_request_tokens(other, b, salt)
    first = i // b
    assert a[:first] == c[:first]
    assert all(x != y for x, y in zip(a[first:], c[first:]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=12), salt_st, salt_st)
def test_a_different_salt_changes_every_block(toks, s1, s2):
    assume(s1 != s2)  # "a" and b"a" are different salts
    a, c = hash_request_tokens(toks, 2, s1), hash_request_tokens(toks, 2, s2)
    assert all(x != y for x, y in zip(a, c))


def test_the_encoding_is_unambiguous():
    t = [1, 2]
    assert hash_block_tokens(None, t, (1, 23)) != hash_block_tokens(None, t, (12, 3))
    assert hash_block_tokens(None, t, ("1",)) != hash_block_tokens(None, t, (1,))
    assert hash_block_tokens(None, t, (b"a",)) != hash_block_tokens(None, t, ("a",))
    assert hash_block_tokens(None, t, (), "x") != hash_block_tokens(None, t, ("x",))
    root = hash_block_tokens(None, t)
    assert hash_block_tokens(root, t) != root
    assert hash_block_tokens(None, t) == hashlib.sha256(
        b"attnplug-block-hash-v1" + b"\x00" + b"\x00" + (2).to_bytes(8, "big")
        + (1).to_bytes(8, "little") + (2).to_bytes(8, "little") + (0).to_bytes(8, "big")).digest()


@pytest.mark.parametrize("call, match", [
    (lambda: hash_block_tokens(None, []), "non-empty"),
    (lambda: hash_block_tokens(None, [-1]), ">= 0"),
    (lambda: hash_block_tokens(b"short", [1]), "32-byte"),
    (lambda: hash_block_tokens(hash_block_tokens(None, [1]), [1], cache_salt="s"), "block 0 only"),
    (lambda: hash_block_tokens(None, [1], (1.5,)), "int, str or bytes"),
    (lambda: hash_request_tokens([1, 2], 0), "positive"),
    (lambda: hash_request_tokens([1, 2], 2, prev_block_hashes=[b"x" * 32] * 2), "previous"),
])
def test_hashing_rejects_bad_input(call, match):
    with pytest.raises(SchedulingError, match=match):
        call()


# --- the pool: units ------------------------------------------------------------------------
def H(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_without_caching_it_allocates_exactly_like_block_pool():
    a, b = BlockPool(7), PrefixCachingBlockPool(7)
    for op in [("a", 3), ("f", [2, 1]), ("a", 4), ("f", [5]), ("a", 1)]:
        if op[0] == "a":
            assert a.allocate(op[1]) == b.allocate(op[1])
        else:
            a.free(op[1]); b.free(op[1])
        assert (a.num_free_blocks, a.num_used_blocks, a.peak_num_used_blocks) == \
               (b.num_free_blocks, b.num_used_blocks, b.peak_num_used_blocks)
    with pytest.raises(SchedulingError, match="double free"):
        b.free([2, 5])  # 5 is free: nothing is freed, 2 stays held
    assert b.is_allocated(2) and not b.is_allocated(5)
    with pytest.raises(SchedulingError, match="twice"):
        b.free([3, 3])
    with pytest.raises(SchedulingError, match="1 of 6 are free"):
        b.allocate(2)
    with pytest.raises(KVCacheSpecError):
        PrefixCachingBlockPool(1)


def test_shared_blocks_free_once_per_holder_and_stay_findable_until_reallocated():
    pool = PrefixCachingBlockPool(5)
    ids = pool.allocate(2)
    assert pool.cache_full_blocks(ids, [H(0), H(1)], 0, 2) == 2
    pool.touch([ids[0]])                     # a second request hits block 0
    pool.free(reversed(ids))                 # the first request finishes
    assert pool.blocks[ids[0]].ref_cnt == 1 and pool.blocks[ids[1]].ref_cnt == 0
    assert pool.get_cached_block(H(1)) == ids[1] and pool.num_free_blocks == 3
    pool.touch([ids[1]])                     # a hit on a free cached block revives it
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 2
    pool.free([ids[1]]); pool.free([ids[0]])
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    assert pool.allocate(2) == [3, 4]        # hashless first: the cache survives
    assert pool.allocate(1) == [ids[1]]      # then LRU: block 1's hash was freed first
    assert pool.get_cached_block(H(1)) is None and pool.get_cached_block(H(0)) == ids[0]
    assert pool.num_evictions == 1
    with pytest.raises(SchedulingError, match="not cached"):
        PrefixCachingBlockPool(3).touch([1])


def test_cache_full_blocks_checks_and_keeps_the_first_duplicate():
    pool = PrefixCachingBlockPool(6)
    a, b = pool.allocate(2), pool.allocate(2)
    assert pool.cache_full_blocks(a, [H(0), H(1)], 0, 1) == 1
    assert pool.cache_full_blocks(a, [H(0), H(1)], 1, 2) == 1
    assert pool.cache_full_blocks(b, [H(0), H(1)], 0, 2) == 0   # same prefix computed twice
    assert pool.get_cached_block(H(0)) == a[0] and pool.blocks[b[0]].block_hash is None
    with pytest.raises(SchedulingError, match="another hash"):
        pool.cache_full_blocks(a, [H(5), H(6)], 0, 1)
    with pytest.raises(SchedulingError, match="num_cached_blocks"):
        pool.cache_full_blocks(a, [H(0)], 0, 2)
    pool.free(b)
    with pytest.raises(SchedulingError, match="not held"):
        pool.cache_full_blocks(b, [H(7), H(8)], 0, 2)
    pool.free(a)
    assert pool.reset_prefix_cache() == 2 and pool.num_cached_blocks == 0


def test_block_managers_run_on_it_with_shared_blocks():
    pool = PrefixCachingBlockPool(9)
    m = SlidingWindowManager(SlidingWindowSpec(block_size=2, sliding_window=3), pool)
    m.allocate_new_blocks("a", 8)
    pool.cache_full_blocks(m.block_ids("a"), [H(i) for i in range(4)], 0, 4)
    shared = list(m.block_ids("a"))
    pool.touch(shared)                       # "b" hits the whole prefix
    m.req_to_blocks["b"] = list(shared)
    m.remove_skipped_blocks("a", 8)          # frees a's first 3 blocks: still held by b
    assert m.block_ids("a")[:3] == [NULL_BLOCK_ID] * 3
    assert [pool.blocks[x].ref_cnt for x in shared] == [1, 1, 1, 2]
    m.free("a"); m.free("b")
    assert pool.num_free_blocks == pool.capacity and pool.num_cached_blocks == 4


# --- the pool: properties -------------------------------------------------------------------
class PoolMachine(RuleBasedStateMachine):
    """Random allocate / hit / cache / free against a model of ref counts and the free queue."""

    N = 9

    def __init__(self):
        super().__init__()
        self.pool = PrefixCachingBlockPool(self.N)
        self.reqs: dict[int, list[int]] = {}
        self.ref = [0] * self.N
        self.hash_of: dict[int, bytes] = {}       # model of cached blocks
        self.fifo = deque(range(1, self.N))       # hashless free blocks
        self.lru: list[int] = []                  # cached free blocks, LRU first
        self.next_req = 0
        self.next_hash = 0

    @rule(n=st.integers(0, 4), hits=st.integers(0, 3))
    def new_request(self, n, hits):
        cached = sorted(self.hash_of)[:hits]
        self.pool.touch(cached)
        for b in cached:
            if self.ref[b] == 0:
                self.lru.remove(b)
            self.ref[b] += 1
        if n > len(self.fifo) + len(self.lru):
            with pytest.raises(SchedulingError):
                self.pool.allocate(n)
            n = 0
        expect = []
        for _ in range(n):
            if self.fifo:
                expect.append(self.fifo.popleft())
            else:
                b = self.lru.pop(0)
                del self.hash_of[b]
                expect.append(b)
        got = self.pool.allocate(n)
        assert got == expect, "eviction order: hashless FIFO, then least recently freed"
        for b in got:
            assert self.ref[b] == 0, f"block {b} handed out while held"
            self.ref[b] = 1
        self.reqs[self.next_req] = cached + got
        self.next_req += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), dup=st.booleans())
    def cache(self, data, dup):
        r = data.draw(st.sampled_from(sorted(self.reqs)))
        blocks = self.reqs[r]
        hashes = []
        for b in blocks:
            if b in self.hash_of:
                hashes.append(self.hash_of[b])
            elif dup and self.hash_of:
                hashes.append(self.hash_of[min(self.hash_of)])   # already cached elsewhere
            else:
                self.next_hash += 1
                hashes.append(H(self.next_hash))
        self.pool.cache_full_blocks(blocks, hashes, 0, len(blocks))
        known = set(self.hash_of.values())
        for b, h in zip(blocks, hashes):
            if b not in self.hash_of and h not in known:
                self.hash_of[b] = h
                known.add(h)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        self.free_one(data.draw(st.sampled_from(sorted(self.reqs))))

    @precondition(lambda self: self.reqs)
    @rule()
    def double_free_is_refused(self):
        free_ids = [b for b in range(1, self.N) if self.ref[b] == 0]
        if free_ids:
            with pytest.raises(SchedulingError, match="double free"):
                self.pool.free([free_ids[0]])

    @rule()
    def free_everything(self):
        for r in sorted(self.reqs):
            self.free_one(r)
        assert self.pool.num_free_blocks == self.pool.capacity and self.pool.num_used_blocks == 0

    def free_one(self, r):
        blocks = self.reqs.pop(r)
        self.pool.free(list(reversed(blocks)))
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (self.lru.append if b in self.hash_of else self.fifo.append)(b)

    @invariant()
    def matches_model(self):
        p = self.pool
        assert [blk.ref_cnt for blk in p.blocks] == self.ref
        assert min(self.ref) >= 0
        assert p.num_used_blocks == sum(1 for c in self.ref if c > 0)
        assert p.num_free_blocks + p.num_used_blocks == p.capacity
        assert {b: blk.block_hash for b, blk in enumerate(p.blocks) if blk.block_hash} == self.hash_of
        for b, h in self.hash_of.items():
            assert p.get_cached_block(h) == b
        assert p.blocks[NULL_BLOCK_ID].ref_cnt == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
