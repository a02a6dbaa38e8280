"""Sliding-window block freeing at every boundary, checked from first principles in the
module itself (no ATTNPLUG_VALIDATE, no runner).

After ``n`` computed tokens the next query is at position ``n`` or later and sees keys
``> p - W``, so token ``t`` is still visible iff ``t >= n - W + 1``. Block ``i`` holds
tokens ``[i*B, (i+1)*B)``: it may be freed iff ``(i+1)*B <= n - W + 1``. The sweep covers
``n - W + 1 ≡ 0, ±1 (mod B)`` for several windows and block sizes, one token at a time
(as decodes advance) and in jumps (chunked prefill)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from attnplug.cache_groups.block_pool import BlockPool, KVCacheManager, SlidingWindowManager
from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.sliding_window import num_skipped_blocks, num_skipped_tokens
from attnplug.cache_groups.specs import SlidingWindowSpec, cdiv
from attnplug.core.constants import NULL_BLOCK_ID

SHAPES = [(1, 4), (3, 4), (4, 4), (5, 4), (6, 4), (8, 4), (9, 2), (7, 1), (16, 8)]  # (W, B)


@pytest.fixture(autouse=True)
def _no_validate(monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)


def freeable(n: int, W: int, B: int) -> int:
    """Blocks wholly before the first key any query at position >= n can see."""
    first_visible = max(0, n - W + 1)
    return sum(1 for i in range(cdiv(n + 1, B) + 1) if (i + 1) * B <= first_visible)


@pytest.mark.parametrize("W, B", SHAPES)
def test_skip_arithmetic_matches_visibility(W, B):
    ns = np.arange(0, 60)
    want = [freeable(int(n), W, B) for n in ns]
    assert [num_skipped_blocks(int(n), W, B) for n in ns] == want
    assert num_skipped_blocks(ns, W, B).tolist() == want  # the vectorized path agrees
    assert num_skipped_tokens(ns, W).tolist() == [max(0, int(n) - W + 1) for n in ns]


@pytest.mark.parametrize("W, B", SHAPES)
@pytest.mark.parametrize("step", [1, 3, 5])
def test_pool_frees_exactly_the_invisible_blocks(W, B, step):
    m = SlidingWindowManager(SlidingWindowSpec(block_size=B, sliding_window=W), BlockPool(64))
    total = 40
    n = 0
    while n < total:
        m.remove_skipped_blocks("r", n)
        m.allocate_new_blocks("r", min(n + step, total))
        blocks = m.block_ids("r")
        k = freeable(n, W, B)
        assert blocks[:k] == [NULL_BLOCK_ID] * k, (n, blocks)
        live = blocks[k:]
        assert NULL_BLOCK_ID not in live, (n, blocks)  # every block a query can still see is held
        assert all(m.pool.is_allocated(b) for b in live), n
        assert m.pool.num_used_blocks == len(live), n
        assert m.num_reclaimable_blocks("r", n) == 0  # already freed
        n = min(n + step, total)
        assert m.num_reclaimable_blocks("r", n) == freeable(n, W, B) - k, n
    m.free("r")
    assert m.pool.num_used_blocks == 0


@dataclass
class Req:
    req_id: str
    num_computed_tokens: int = 0


@pytest.mark.parametrize("W, B", [(5, 4), (9, 4), (6, 2)])
def test_manager_frees_at_the_boundary_before_allocating(W, B):
    """KVCacheManager.allocate_slots frees the window's invisible blocks first; at the
    boundary ``n - W + 1 = k*B`` block ``k-1`` goes, block ``k`` stays."""
    spec = SlidingWindowSpec(block_size=B, sliding_window=W)
    kv = KVCacheManager(KVCacheConfig(32, (KVCacheGroupSpec(("l0",), spec),)))
    req = Req("r")
    kv.allocate_slots(req, 2 * B + W)
    for n in range(1, 3 * B + W):
        req.num_computed_tokens = n
        kv.allocate_slots(req, 1)
        (blocks,) = kv.get_block_ids("r")
        k = freeable(n, W, B)
        assert blocks[:k] == [NULL_BLOCK_ID] * k and NULL_BLOCK_ID not in blocks[k:], (n, blocks)
        if (n - W + 1) % B == 0 and n - W + 1 > 0:
            assert blocks[k - 1] == NULL_BLOCK_ID and blocks[k] != NULL_BLOCK_ID, n
