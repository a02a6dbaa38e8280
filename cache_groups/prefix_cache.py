"""A block pool with reference counts and prefix caching (vLLM V1's ``BlockPool`` with
``enable_caching``; names and semantics, not code).

:class:`PrefixCachingBlockPool` is a drop-in for :class:`~attnplug.cache_groups.block_pool.BlockPool`
(same ``allocate`` / ``free`` / ``num_free_blocks`` / ``num_used_blocks`` /
``peak_num_used_blocks`` / ``capacity`` / ``is_allocated`` / ``reset_peak``, same errors),
so the per-group managers of ``block_pool.py`` run on it unchanged. On top of that:

* Every block is a :class:`KVCacheBlock` with a ``ref_cnt`` (how many requests hold it)
  and, once full and computed, a ``block_hash`` (``cache_groups/block_hash.py``).
* ``cache_full_blocks`` registers a request's newly computed full blocks under their
  hashes; ``get_cached_block(hash)`` finds one. A block several requests share is in each
  one's block list and freed by each; it returns to the free queue when ``ref_cnt`` reaches 0.
* The free queue has two tiers. Blocks without a hash (never filled, or evicted) are
  handed out first, FIFO — exactly ``BlockPool``'s order, so a pool in which nothing was
  ever cached allocates the same ids as ``BlockPool``. Freed blocks that carry a hash stay
  findable and go to the most-recently-used end of an LRU list; they are handed out (and
  their hash evicted) only when no hashless block is free, least recently freed first.
  ``touch`` takes a cached block back for a new request (a prefix hit): ``ref_cnt`` goes
  up and a free one leaves the queue, so a block with ``ref_cnt > 0`` is never evicted.

How the scheduler uses it (``runner/serve/kv_cache_manager.py``; docs/architecture.md, "Prefix caching"):
at admission, ``HybridPrefixCoordinator.get_computed_blocks`` (``cache_groups/hybrid_hits.py``)
finds the hit; the scheduler ``touch``es the hit's blocks in each group's pool, starts the
request with ``num_computed_tokens`` = the hit length and its block lists = the hit's ids,
then allocates the rest as usual. After each step it calls ``cache_full_blocks`` for the
blocks that became full. Freeing a request frees its blocks in reverse logical order, so
a prompt's tail (the least shareable part) is evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Sequence

from attnplug.cache_groups.block_hash import BlockHash
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import KVCacheSpecError, SchedulingError


class KVCacheBlock:
    """One physical block's bookkeeping.

    Attributes:
        block_id: its id in the pool, ``0 .. num_blocks - 1``.
        ref_cnt: requests holding it now (``>= 0``); 0 means it is in the free queue.
        block_hash: the hash it is cached under, or ``None`` (not cached).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else self.block_hash[:4].hex()
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class PrefixCachingBlockPool:
    """The physical blocks of one cache group, reference counted, with a prefix cache.

    Args:
        num_blocks: physical blocks including the null block; ``>= 2``.

    Raises:
        KVCacheSpecError: ``num_blocks < 2``.

    Examples:
        >>> from attnplug.cache_groups.block_hash import hash_request_tokens
        >>> pool = PrefixCachingBlockPool(4)
        >>> a = pool.allocate(2)                        # [1, 2]
        >>> hashes = hash_request_tokens([5, 6, 7, 8], 2)
        >>> pool.cache_full_blocks(a, hashes, 0, 2)
        2
        >>> pool.free(reversed(a)); pool.num_free_blocks
        3
        >>> pool.get_cached_block(hashes[0])           # still findable while free
        1
        >>> pool.allocate(2)                            # hashless 3 first, then LRU 2
        [3, 2]
        >>> pool.get_cached_block(hashes[1]) is None    # 2 was evicted
        True
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise KVCacheSpecError(
                f"a block pool needs num_blocks >= 2 (block {NULL_BLOCK_ID} is the reserved null "
                f"block), got {num_blocks!r}; raise --num-blocks")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(1, num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self.cached_block_hash_to_block: dict[BlockHash, int] = {}
        self._num_used = 0
        self._peak_num_used = 0
        self.num_evictions = 0

    # --- BlockPool's interface ----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now: hashless free ones plus cached free ones."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ``ref_cnt > 0`` (a block shared by several requests counts once)."""
        return self._num_used

    @property
    def peak_num_used_blocks(self) -> int:
        """The largest ``num_used_blocks`` since creation or the last ``reset_peak``."""
        return self._peak_num_used

    @property
    def capacity(self) -> int:
        """Blocks requests can ever hold: ``num_blocks - 1``."""
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash (held or free)."""
        return len(self.cached_block_hash_to_block)

    def reset_peak(self) -> None:
        """Restart peak tracking from the current usage."""
        self._peak_num_used = self._num_used

    def is_allocated(self, block_id: int) -> bool:
        """Whether some request holds ``block_id`` (``ref_cnt > 0``)."""
        return self.blocks[block_id].ref_cnt > 0

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (all or nothing), each with ``ref_cnt`` 1.

        Hashless blocks first (FIFO), then cached free blocks from the LRU end; a cached
        block handed out loses its hash (it is evicted: ``get_cached_block`` no longer
        finds it).

        Args:
            n: blocks wanted, ``>= 0``.

        Returns:
            ``n`` distinct ids, never ``NULL_BLOCK_ID``, none held by a request.

        Raises:
            SchedulingError: ``n`` negative or above ``num_free_blocks``; nothing allocated.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n > self.num_free_blocks:
            raise SchedulingError(
                f"cannot allocate {n} blocks: {self.num_free_blocks} of {self.capacity} are free; "
                "check num_free_blocks (or use KVCacheManager.allocate_slots, which returns None "
                "when short) before allocating")
        ids = []
        for _ in range(n):
            if self._free_uncached:
                bid = self._free_uncached.popleft()
            else:
                bid, _ = self._free_cached.popitem(last=False)
                self._evict(self.blocks[bid])
            self.blocks[bid].ref_cnt = 1
            ids.append(bid)
        self._num_used += n
        self._peak_num_used = max(self._peak_num_used, self._num_used)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the given order.

        A block whose ``ref_cnt`` reaches 0 joins the free queue: the LRU list's
        most-recently-used end if it has a hash (still findable), else the FIFO tail.
        ``NULL_BLOCK_ID`` entries are ignored; all ids are checked before any changes.

        Raises:
            SchedulingError: an id out of range, one with ``ref_cnt == 0`` (double free),
                or one listed twice; nothing is freed.
        """
        ids = self._checked_ids(block_ids, "free")
        for bid in ids:
            if self.blocks[bid].ref_cnt == 0:
                raise SchedulingError(
                    f"double free of block {bid}: it is not allocated; a request's blocks must be "
                    "freed exactly once")
        for bid in ids:
            blk = self.blocks[bid]
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._num_used -= 1
                if blk.block_hash is not None:
                    self._free_cached[bid] = None
                else:
                    self._free_uncached.append(bid)

    # --- prefix caching -----------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The id of the block cached under ``block_hash`` (held or free), or ``None``."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block of a prefix hit (vLLM's ``touch``).

        A block with ``ref_cnt == 0`` leaves the free queue, so it can no longer be
        evicted. ``NULL_BLOCK_ID`` entries (a sliding window's skipped blocks, a Mamba
        hit's unread checkpoints) are ignored. All ids are checked before any changes.

        Raises:
            SchedulingError: an id out of range or listed twice, or a free block without a
                hash (its contents are not a cached prefix); nothing changes.
        """
        ids = self._checked_ids(block_ids, "touch")
        for bid in ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0 and blk.block_hash is None:
                raise SchedulingError(
                    f"cannot touch block {bid}: it is free and not cached, so it holds no prefix; "
                    "touch only ids returned by get_cached_block")
        for bid in ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                del self._free_cached[bid]
                self._num_used += 1
            blk.ref_cnt += 1
        self._peak_num_used = max(self._peak_num_used, self._num_used)

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> int:
        """Register a request's blocks ``num_cached_blocks .. num_full_blocks - 1`` under their hashes.

        Called after a step computed them. ``block_ids`` is the request's block list in
        this group (logical order), ``block_hashes`` its hash chain at this group's block
        size. Null entries are skipped (a sliding window may have given them back). A
        block already cached under the same hash is left as is; when another block already
        holds the hash (two requests computed the same prefix at once) this one stays
        uncached and the first keeps serving hits.

        Args:
            block_ids: the request's blocks in this pool.
            block_hashes: at least ``num_full_blocks`` hashes.
            num_cached_blocks: blocks of this request handled by earlier calls.
            num_full_blocks: blocks now full and computed.

        Returns:
            How many blocks this call newly registered.

        Raises:
            SchedulingError: bounds out of order or past the lists, a block not held by a
                request, or one already cached under a different hash; nothing changes.
        """
        if not 0 <= num_cached_blocks <= num_full_blocks <= min(len(block_ids), len(block_hashes)):
            raise SchedulingError(
                f"cache_full_blocks: need 0 <= num_cached_blocks ({num_cached_blocks}) <= num_full_blocks "
                f"({num_full_blocks}) <= blocks ({len(block_ids)}) and hashes ({len(block_hashes)})")
        todo = []
        for i in range(num_cached_blocks, num_full_blocks):
            bid = int(block_ids[i])
            if bid == NULL_BLOCK_ID:
                continue
            if not 0 < bid < self.num_blocks or self.blocks[bid].ref_cnt == 0:
                raise SchedulingError(f"cache_full_blocks: block {bid} (logical {i}) is not held by a request")
            have = self.blocks[bid].block_hash
            if have is not None and have != block_hashes[i]:
                raise SchedulingError(
                    f"cache_full_blocks: block {bid} (logical {i}) is cached under another hash; "
                    "a block's contents never change while it is held")
            if have is None:
                todo.append((bid, block_hashes[i]))
        n = 0
        for bid, h in todo:
            if h not in self.cached_block_hash_to_block:
                self.cached_block_hash_to_block[h] = bid
                self.blocks[bid].block_hash = h
                n += 1
        return n

    def reset_prefix_cache(self) -> int:
        """Forget every hash of a free block (held blocks keep theirs); returns how many.

        Their blocks move to the hashless FIFO tier, least recently used first.
        """
        n = len(self._free_cached)
        while self._free_cached:
            bid, _ = self._free_cached.popitem(last=False)
            self._evict(self.blocks[bid], count=False)
            self._free_uncached.append(bid)
        return n

    # --- internals ----------------------------------------------------------------------
    def _evict(self, blk: KVCacheBlock, count: bool = True) -> None:
        del self.cached_block_hash_to_block[blk.block_hash]
        blk.block_hash = None
        if count:
            self.num_evictions += 1

    def _checked_ids(self, block_ids: Iterable[int], what: str) -> list[int]:
        ids = [int(b) for b in block_ids if b != NULL_BLOCK_ID]
        for bid in ids:
            if not 0 < bid < self.num_blocks:
                raise SchedulingError(
                    f"cannot {what} block {bid}: ids of this pool are 1..{self.num_blocks - 1}")
        if len(set(ids)) != len(ids):
            raise SchedulingError(f"block ids {ids} list a block twice; each block is {what}d once per call")
        return ids
