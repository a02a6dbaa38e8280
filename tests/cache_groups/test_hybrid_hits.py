"""Hybrid prefix-cache hit rules (cache_groups/hybrid_hits.py): a brute-force oracle and crafted cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplug.cache_groups.block_hash import hash_request_tokens
from attnplug.cache_groups.hybrid_hits import (
    HybridPrefixCoordinator,
    find_longest_cache_hit,
)
from attnplug.cache_groups.prefix_cache import PrefixCachingBlockPool
from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec, cdiv
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import KVCacheSpecError

FULL4 = FullAttentionSpec(block_size=4)


def valid(spec, cached, h):
    """Whether group `spec` can restore a hit of h tokens, straight from the rules."""
    b = spec.block_size
    if h % b:
        return False
    k = h // b
    if k > len(cached):  # the lookup covers the request's full blocks only
        return False
    have = lambda i: i < len(cached) and cached[i] is not None  # noqa: E731
    if isinstance(spec, SlidingWindowSpec):
        first = max(0, h - spec.sliding_window + 1) // b      # block of the first visible key
        return all(have(i) for i in range(first, k))
    if isinstance(spec, MambaSpec):
        return k == 0 or have(k - 1)
    return all(have(i) for i in range(k))


def expected_ids(spec, cached, h):
    b, k = spec.block_size, h // spec.block_size
    if isinstance(spec, SlidingWindowSpec):
        first = max(0, h - spec.sliding_window + 1) // b
        return tuple(NULL_BLOCK_ID if i < first else cached[i] for i in range(k))
    if isinstance(spec, MambaSpec):
        return tuple(NULL_BLOCK_ID if i < k - 1 else cached[i] for i in range(k))
    return tuple(cached[:k])


spec_st = st.one_of(
    st.builds(FullAttentionSpec, block_size=st.sampled_from([2, 4])),
    st.builds(SlidingWindowSpec, block_size=st.sampled_from([2, 4]), sliding_window=st.integers(1, 13)),
    st.builds(MambaSpec, block_size=st.sampled_from([4, 8])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(spec_st, min_size=1, max_size=4), st.integers(0, 40), st.data())
def test_the_hit_is_the_longest_prefix_every_group_can_restore(specs, max_length, data):
    cached = []
    for g, s in enumerate(specs):
        n = data.draw(st.integers(0, 40 // s.block_size + 1))
        mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
        cached.append([100 * g + i + 1 if m else None for i, m in enumerate(mask)])
    hit = find_longest_cache_hit(specs, cached, max_length)
    want = next(h for h in range(max_length, -1, -1) if all(valid(s, c, h) for s, c in zip(specs, cached)))
    assert hit.num_computed_tokens == want
    assert hit.block_ids == tuple(expected_ids(s, c, want) for s, c in zip(specs, cached))


# --- crafted cases, through real pools and hashes --------------------------------------------
def compute_and_cache(coord, tokens, salt=None):
    """Request "A" computes all of `tokens` and caches its full blocks, then finishes."""
    hashes = coord.block_hashes(tokens, salt)
    for s, p in zip(coord.specs, coord.pools):
        ids = p.allocate(cdiv(len(tokens), s.block_size))
        n_full = len(tokens) // s.block_size
        p.cache_full_blocks(ids, hashes[s.block_size], 0, n_full)
        p.free(list(reversed(ids)))


def make(*specs, num_blocks=32):
    return HybridPrefixCoordinator(specs, [PrefixCachingBlockPool(num_blocks) for _ in specs])


def test_full_attention_hits_whole_blocks_and_leaves_the_last_token_to_compute():
    coord = make(FULL4)
    prompt = list(range(12))
    compute_and_cache(coord, prompt)
    assert coord.get_computed_blocks(prompt).num_computed_tokens == 8      # not 12: one token left
    assert coord.get_computed_blocks(prompt + [99]).num_computed_tokens == 12
    assert coord.get_computed_blocks(prompt[:10] + [7, 7, 7]).num_computed_tokens == 8
    assert coord.get_computed_blocks(prompt + [99], cache_salt="other").num_computed_tokens == 0
    hit = coord.get_computed_blocks(prompt + [99])
    coord.pools[0].touch(hit.block_ids[0])
    assert all(coord.pools[0].blocks[b].ref_cnt == 1 for b in hit.block_ids[0])


def test_bamba_shared_prefix_ending_mid_mamba_block_falls_back_to_the_previous_boundary():
    # attention blocks of 4, Mamba checkpoints every 8 tokens
    coord = make(FULL4, MambaSpec(block_size=8))
    a = list(range(100, 116))                      # 16 tokens: checkpoints after 8 and 16
    compute_and_cache(coord, a)
    b = a[:13] + [1, 2, 3, 4, 5]                   # shares 13 tokens: attention alone hits 12
    attn_only = make(FULL4)
    compute_and_cache(attn_only, a)
    assert attn_only.get_computed_blocks(b).num_computed_tokens == 12
    hit = coord.get_computed_blocks(b)
    assert hit.num_computed_tokens == 8            # 12 is no Mamba checkpoint: back to 8
    assert len(hit.block_ids[0]) == 2 and len(hit.block_ids[1]) == 1
    # with the whole prompt shared plus one token, the hit is the 16-token checkpoint
    full = coord.get_computed_blocks(a + [0])
    assert full.num_computed_tokens == 16 and full.block_ids[1][0] == NULL_BLOCK_ID


def test_sliding_window_hits_when_only_the_window_is_cached():
    sw = SlidingWindowSpec(block_size=4, sliding_window=5)       # needs cdiv(4, 4) = 1 block
    coord = make(sw, num_blocks=8)
    prompt = list(range(20))                                    # 5 blocks, freed tail first
    compute_and_cache(coord, prompt)
    coord.pools[0].allocate(5)    # 2 hashless, then the LRU 3: logical blocks 4, 3, 2 evicted
    hit = coord.get_computed_blocks(prompt + [1])
    assert hit.num_computed_tokens == 8 and hit.block_ids[0] == (NULL_BLOCK_ID, 2)
    # Gemma-like: the full group has everything, the window group only its last block
    cached = [[1, 2, 3, 4, 5], [None, None, None, None, 15]]
    hit = find_longest_cache_hit([FULL4, sw], cached, 20)
    assert hit.num_computed_tokens == 20 and hit.block_ids[1] == (0, 0, 0, 0, 15)
    assert find_longest_cache_hit([FULL4], cached[1:], 20).num_computed_tokens == 0


def test_each_window_its_own_rule_and_the_hit_is_the_minimum():
    narrow = SlidingWindowSpec(block_size=4, sliding_window=4)   # 1 block before the hit
    wide = SlidingWindowSpec(block_size=4, sliding_window=12)    # 3 blocks before the hit
    blocks = [1, 2, 3, 4, None, 6]                               # logical block 4 evicted
    assert find_longest_cache_hit([narrow], [blocks], 24).num_computed_tokens == 24
    assert find_longest_cache_hit([wide], [blocks], 24).num_computed_tokens == 16
    both = find_longest_cache_hit([narrow, wide], [blocks, blocks], 24)
    assert both.num_computed_tokens == 16
    assert both.block_ids == ((0, 0, 0, 4), (0, 2, 3, 4))


def test_the_fixed_point_drops_below_a_length_every_group_rejects():
    # at 20 full attention and the window are valid but 20 is no Mamba checkpoint; at 16
    # the window needs block 3 (evicted); at 8 Mamba needs checkpoint 0.
    sw, mamba = SlidingWindowSpec(block_size=4, sliding_window=5), MambaSpec(block_size=8)
    cached = [[1, 2, 3, 4, 5], [11, 12, None, None, 15], [None, 22]]
    assert find_longest_cache_hit([FULL4, sw, mamba], cached, 23).num_computed_tokens == 0
    cached[2][0] = 21
    hit = find_longest_cache_hit([FULL4, sw, mamba], cached, 23)
    assert hit.num_computed_tokens == 8 and hit.block_ids == ((1, 2), (0, 12), (21,))


def test_a_hit_over_groups_it_does_not_know_is_refused():
    with pytest.raises(KVCacheSpecError):
        find_longest_cache_hit([FULL4], [[], []], 3)


def test_hashes_are_shared_by_groups_of_one_block_size():
    coord = make(FULL4, SlidingWindowSpec(block_size=4, sliding_window=3), MambaSpec(block_size=8))
    h = coord.block_hashes(list(range(17)), "s")
    assert sorted(h) == [4, 8]
    assert h[4] == hash_request_tokens(list(range(17)), 4, "s") and len(h[8]) == 2
