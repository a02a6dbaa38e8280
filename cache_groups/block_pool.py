"""Block pools and the per-group block managers the scheduler allocates KV-cache from.

Three layers, one concept each:

* :class:`BlockPool` — one cache group's physical blocks: a FIFO free list over ids
  ``1 .. num_blocks - 1``; block ``NULL_BLOCK_ID`` (0) is reserved and never handed out.
* Per-group policies (one subclass per ``KVCacheSpec.kind``), which decide how many blocks a
  request needs for ``n`` tokens and which blocks it may give back early:
  :class:`FullAttentionManager` (``cdiv(n, block_size)``, nothing freed early),
  :class:`SlidingWindowManager` (blocks no future query can see become ``NULL_BLOCK_ID`` and
  return to the pool; the block table never shifts) and :class:`MambaStateManager` (state slots).
* :class:`KVCacheManager` — the coordinator over all groups: all-or-nothing allocation of
  a step's new blocks in every group, and freeing a request everywhere.

Conventions: vLLM V1's ``BlockPool`` / ``SingleTypeKVCacheManager`` / ``KVCacheManager`` (no prefix caching here).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Protocol

import numpy as np

from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.cache_groups.sliding_window import max_live_blocks, num_skipped_blocks
from attnplug.cache_groups.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
    cdiv,
)
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import KVCacheSpecError, SchedulingError


class BlockPool:
    """The physical blocks of one cache group.

    Block ids are ints in ``[0, num_blocks)``. ``NULL_BLOCK_ID`` (0) is reserved: it is
    never allocated and freeing it is a no-op, so block tables may hold it as padding or,
    for sliding windows, in place of freed blocks. The free list is FIFO: ``allocate``
    pops from the head, ``free`` appends to the tail, so allocation order is
    deterministic for a given history (first allocation of a fresh pool: ``1, 2, 3, ...``).

    Args:
        num_blocks: physical blocks in the pool, including the null block; ``>= 2``.

    Raises:
        KVCacheSpecError: ``num_blocks < 2``.

    Examples:
        >>> pool = BlockPool(4)
        >>> pool.allocate(2), pool.num_free_blocks
        ([1, 2], 1)
        >>> pool.free([1, NULL_BLOCK_ID]); pool.allocate(2)
        [3, 1]
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise KVCacheSpecError(
                f"a block pool needs num_blocks >= 2 (block {NULL_BLOCK_ID} is the reserved null "
                f"block), got {num_blocks!r}; raise --num-blocks")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._in_use = np.zeros(num_blocks, dtype=np.bool_)
        self._num_used = 0
        self._peak_num_used = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (the null block is never counted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks currently owned by requests."""
        return self._num_used

    @property
    def peak_num_used_blocks(self) -> int:
        """The largest ``num_used_blocks`` seen since creation or the last ``reset_peak``."""
        return self._peak_num_used

    @property
    def capacity(self) -> int:
        """Blocks a request can ever own: ``num_blocks - 1``."""
        return self.num_blocks - 1

    def reset_peak(self) -> None:
        """Restart peak tracking from the current usage."""
        self._peak_num_used = self._num_used

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free list (all or nothing).

        Callers check ``num_free_blocks`` first (``KVCacheManager.allocate_slots`` does and
        returns ``None`` when a group is short); running out here is a protocol error.

        Args:
            n: blocks wanted, ``>= 0``.

        Returns:
            ``n`` distinct block ids, none of them ``NULL_BLOCK_ID``.

        Raises:
            SchedulingError: ``n`` is negative or larger than ``num_free_blocks``; nothing
                is allocated.
        """
        if n < 0 or n > len(self._free):
            raise SchedulingError(
                f"cannot allocate {n} blocks: {len(self._free)} of {self.capacity} are free; "
                "check num_free_blocks (or use KVCacheManager.allocate_slots, which returns None "
                "when short) before allocating")
        ids = [self._free.popleft() for _ in range(n)]
        self._in_use[ids] = True
        self._num_used += n
        self._peak_num_used = max(self._peak_num_used, self._num_used)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the tail of the free list, in the given order.

        ``NULL_BLOCK_ID`` entries are ignored. All ids are checked before any is freed.

        Raises:
            SchedulingError: an id out of range, not currently allocated (double free), or
                listed twice; nothing is freed.
        """
        ids = [int(b) for b in block_ids if b != NULL_BLOCK_ID]
        if not ids:
            return
        arr = np.asarray(ids, dtype=np.int64)
        bad_range = (arr < 0) | (arr >= self.num_blocks)
        if bad_range.any():
            raise SchedulingError(
                f"cannot free block {int(arr[bad_range][0])}: ids of this pool are 1..{self.num_blocks - 1}")
        not_used = ~self._in_use[arr]
        if not_used.any():
            raise SchedulingError(
                f"double free of block {int(arr[not_used][0])}: it is not allocated; a request's "
                "blocks must be freed exactly once")
        if len(np.unique(arr)) != len(ids):
            raise SchedulingError(f"block ids {ids} list a block twice; each block is freed once")
        self._in_use[arr] = False
        self._free.extend(ids)
        self._num_used -= len(ids)

    def is_allocated(self, block_id: int) -> bool:
        """Whether ``block_id`` is currently owned by some request."""
        return bool(self._in_use[block_id])


class RequestLike(Protocol):
    """What the managers read from a scheduler request."""

    req_id: str
    num_computed_tokens: int


class SingleTypeBlockManager:
    """Per-group block policy: which blocks a request owns in one cache group.

    The base class is full attention's policy: a request holding ``n`` tokens owns
    ``cdiv(n, block_size)`` blocks, in logical order, and gives them all back on ``free``.
    Subclasses override the four policy hooks (``num_blocks_needed``,
    ``remove_skipped_blocks``, ``num_reclaimable_blocks``, ``max_blocks_per_request``).

    Args:
        spec: the group's spec (``spec.block_size`` tokens per block).
        pool: the group's pool.
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool):
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.req_to_blocks: dict[str, list[int]] = {}

    # --- policy hooks -------------------------------------------------------------------
    def num_blocks_needed(self, num_tokens: int) -> int:
        """Length of the block list of a request holding K/V of ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_reclaimable_blocks(self, req_id: str, num_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks(req_id, num_computed_tokens)`` would free."""
        return 0

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future query of the request can read (none for full attention)."""

    def max_blocks_per_request(self, max_num_tokens: int, max_num_batched_tokens: int) -> int:
        """Most blocks one request can own at once while growing to ``max_num_tokens``."""
        return self.num_blocks_needed(max_num_tokens)

    # --- mechanics ----------------------------------------------------------------------
    def block_ids(self, req_id: str) -> list[int]:
        """The request's block list (the live list; do not mutate). Empty when it has none."""
        return self.req_to_blocks.get(req_id, [])

    def get_num_blocks_to_allocate(self, req_id: str, num_tokens: int) -> int:
        """New blocks needed for the request to hold ``num_tokens`` tokens."""
        return max(0, self.num_blocks_needed(num_tokens) - len(self.block_ids(req_id)))

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow the request's list to hold ``num_tokens`` tokens; returns the new ids.

        Raises:
            SchedulingError: the pool is short (check first).
        """
        new_ids = self.pool.allocate(self.get_num_blocks_to_allocate(req_id, num_tokens))
        if new_ids or req_id not in self.req_to_blocks:
            self.req_to_blocks.setdefault(req_id, []).extend(new_ids)
        return new_ids

    def free(self, req_id: str) -> None:
        """Give all of the request's blocks back (null entries skipped); no-op if it has none."""
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks:
            self.pool.free(blocks)


class FullAttentionManager(SingleTypeBlockManager):
    """Full causal attention: every token's K/V stays until the request is freed."""


class SlidingWindowManager(SingleTypeBlockManager):
    """Sliding window ``W``: key ``k`` is visible to query ``p`` iff ``p - W < k <= p``.

    After ``n`` computed tokens the next query is at position ``n`` or later, so tokens
    ``0 .. n - W`` (``max(0, n - W + 1)`` of them) are never read again. Whole blocks
    before that point become ``NULL_BLOCK_ID`` in the request's list and return to the
    pool; the list never shifts, so logical block ``i`` still covers tokens
    ``[i * block_size, (i + 1) * block_size)``. A request then owns at most
    ``cdiv(W - 1 + max_num_batched_tokens, block_size) + 1`` live blocks.
    """

    def __init__(self, spec: SlidingWindowSpec, pool: BlockPool):
        super().__init__(spec, pool)
        self.sliding_window = spec.sliding_window

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return num_skipped_blocks(num_computed_tokens, self.sliding_window, self.block_size)

    def _skippable_live(self, req_id: str, num_computed_tokens: int) -> list[int]:
        blocks = self.block_ids(req_id)
        end = min(self._num_skipped_blocks(num_computed_tokens), len(blocks))
        live = []
        # Blocks are nulled front to back, so scan back from `end` to the first null one.
        for i in range(end - 1, -1, -1):
            if blocks[i] == NULL_BLOCK_ID:
                break
            live.append(i)
        return live

    def num_reclaimable_blocks(self, req_id: str, num_computed_tokens: int) -> int:
        return len(self._skippable_live(req_id, num_computed_tokens))

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        idx = self._skippable_live(req_id, num_computed_tokens)
        if not idx:
            return
        blocks = self.req_to_blocks[req_id]
        freed = [blocks[i] for i in reversed(idx)]
        self.pool.free(freed)
        for i in idx:
            blocks[i] = NULL_BLOCK_ID

    def max_blocks_per_request(self, max_num_tokens: int, max_num_batched_tokens: int) -> int:
        window_bound = max_live_blocks(self.sliding_window, max_num_batched_tokens, self.block_size)
        return min(window_bound, self.num_blocks_needed(max_num_tokens))


class MambaStateManager(SingleTypeBlockManager):
    """Mamba state: ``slots_per_request`` slots per request, admission to finish or preemption (its
    state, then a scratch slot per draft position: docs/speculative-decoding.md, "State groups")."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, slots_per_request: int = 1):
        super().__init__(spec, pool)
        self.slots_per_request = slots_per_request

    def num_blocks_needed(self, num_tokens: int) -> int:
        return self.slots_per_request if num_tokens > 0 else 0


def make_block_manager(spec: KVCacheSpec, pool: BlockPool, state_slots: int = 1) -> SingleTypeBlockManager:
    """The policy class for ``spec`` (dispatch on its type; ``state_slots`` per request for Mamba).

    Raises:
        KVCacheSpecError: a spec type without a block policy.
    """
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, pool)
    if isinstance(spec, StateSpec):
        return MambaStateManager(spec, pool, state_slots)
    raise KVCacheSpecError(
        f"no block policy for {type(spec).__name__}; supported: FullAttentionSpec, "
        "SlidingWindowSpec, StateSpec")


class KVCacheManager:
    """Coordinates one :class:`BlockPool` and one block policy per cache group.

    Args:
        kv_cache_config: the groups and their pool sizes (``num_blocks_of``).

    Raises:
        KVCacheSpecError: a group's spec has no block policy, or ``num_blocks < 2``.
    """

    def __init__(self, kv_cache_config: KVCacheConfig):
        self.kv_cache_config = kv_cache_config
        self.pools = [BlockPool(kv_cache_config.num_blocks_of(g)) for g in range(len(kv_cache_config.groups))]
        self.managers = [make_block_manager(g.kv_cache_spec, p, kv_cache_config.state_slots_per_request)
                         for g, p in zip(kv_cache_config.groups, self.pools)]

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """Per group, the request's block list (live lists; copy before keeping)."""
        return tuple(m.block_ids(req_id) for m in self.managers)

    def _num_new_tokens_ok(self, request: RequestLike, num_new_tokens: int) -> None:
        if num_new_tokens < 0:
            raise SchedulingError(
                f"request {request.req_id!r}: num_new_tokens must be >= 0, got {num_new_tokens}")

    def can_allocate(self, request: RequestLike, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens)`` would succeed now."""
        self._num_new_tokens_ok(request, num_new_tokens)
        total = request.num_computed_tokens + num_new_tokens
        for m in self.managers:
            need = m.get_num_blocks_to_allocate(request.req_id, total)
            avail = m.pool.num_free_blocks + m.num_reclaimable_blocks(
                request.req_id, request.num_computed_tokens)
            if need > avail:
                return False
        return True

    def allocate_slots(self, request: RequestLike,
                       num_new_tokens: int) -> tuple[list[int], ...] | None:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        First returns blocks no future query can see (sliding-window groups) — always
        valid — then allocates in every group or in none.

        Args:
            request: has ``req_id`` and ``num_computed_tokens`` (tokens whose K/V is cached).
            num_new_tokens: tokens to be computed this step.

        Returns:
            Per group, the newly allocated block ids (logical order, appended to the
            request's lists; possibly empty), or ``None`` when some group's pool is short
            (nothing allocated then).

        Raises:
            SchedulingError: ``num_new_tokens < 0``.
        """
        if not self.can_allocate(request, num_new_tokens):
            return None
        for m in self.managers:
            m.remove_skipped_blocks(request.req_id, request.num_computed_tokens)
        total = request.num_computed_tokens + num_new_tokens
        return tuple(m.allocate_new_blocks(request.req_id, total) for m in self.managers)

    def free(self, request: RequestLike | str) -> None:
        """Give back every block of the request in every group (finish or preemption)."""
        req_id = request if isinstance(request, str) else request.req_id
        for m in self.managers:
            m.free(req_id)

    def max_blocks_per_request(self, max_num_tokens: int,
                               max_num_batched_tokens: int) -> list[int]:
        """Per group, most blocks one request holding ``max_num_tokens`` can own at once."""
        return [m.max_blocks_per_request(max_num_tokens, max_num_batched_tokens)
                for m in self.managers]

    @property
    def capacity_per_group(self) -> list[int]:
        """Per group, blocks a request could ever get (``num_blocks - 1``)."""
        return [p.capacity for p in self.pools]

    @property
    def num_free_blocks_per_group(self) -> list[int]:
        return [p.num_free_blocks for p in self.pools]

    @property
    def num_used_blocks_per_group(self) -> list[int]:
        return [p.num_used_blocks for p in self.pools]

    @property
    def peak_blocks_per_group(self) -> list[int]:
        """Per group, the peak of blocks owned by requests at once."""
        return [p.peak_num_used_blocks for p in self.pools]
