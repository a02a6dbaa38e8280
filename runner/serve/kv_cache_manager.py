"""Prefix caching in the scheduler: a ``KVCacheManager`` over ``PrefixCachingBlockPool``s.

:class:`PrefixCachingKVCacheManager` is the scheduler's block manager when
``SchedulerConfig.enable_prefix_caching`` is set (vLLM V1's ``KVCacheManager`` with
``enable_caching``; names and semantics, not code). Per group it runs the same block
policy as :class:`~attnplug.cache_groups.block_pool.KVCacheManager` on a reference-counted
:class:`~attnplug.cache_groups.prefix_cache.PrefixCachingBlockPool`, and one
:class:`~attnplug.cache_groups.hybrid_hits.HybridPrefixCoordinator` over all groups finds
hits valid for every group at once (full attention: every block of the prefix; a sliding
window: the ``cdiv(W - 1, B)`` blocks before the hit point, earlier ones ``NULL_BLOCK_ID``).

The scheduler's three hooks:

1. ``get_computed_blocks(request)`` at admission (a new request, or one resumed after
   preemption, which may hit its own freed blocks): the hit, changing nothing.
2. ``allocate_slots(request, n, hit)``: all or nothing: the hit's blocks are ``touch``ed
   (``ref_cnt`` up; a free cached block leaves the free queue, so it cannot be evicted),
   the request's lists start as the hit's ids, then ``n`` more tokens are allocated. The
   scheduler then sets ``num_computed_tokens`` to the hit length.
3. ``cache_blocks(request)`` after each step: blocks that became full and computed are
   registered under their chained hashes; ``free`` (finish, abort, preemption) drops one
   reference per block in reverse logical order, so a prompt's tail is evicted before its
   shareable head. A preempted request's cached blocks stay findable until evicted.

Mamba groups: a request's state slot is overwritten every step, so hits restore a copy
saved at a multiple of the Mamba block size (``runner/serve/mamba_checkpoints.py``: chunks
aligned to those multiples, saves after and restores before the forward, carried by
``SchedulerOutput.mamba_state_copies``). Not with asynchronous scheduling or without chunked
prefill: a model with a Mamba group then gets no hits (``disabled_reason`` says why).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attnplug.cache_groups.block_hash import BlockHash
from attnplug.cache_groups.block_pool import KVCacheManager, RequestLike, make_block_manager
from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.cache_groups.hybrid_hits import CacheHit, HybridPrefixCoordinator
from attnplug.cache_groups.prefix_cache import PrefixCachingBlockPool
from attnplug.cache_groups.specs import StateSpec
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import SchedulingError
from attnplug.runner.serve.mamba_checkpoints import MambaCheckpoints, MambaStateCopies
from attnplug.runner.serve.mamba_checkpoints import mamba_block_size as default_mamba_block_size

NO_HIT = CacheHit(0, ())
"""The empty hit (also what a manager without prefix caching returns)."""


@dataclass
class PrefixCacheStats:
    """Lookups since creation (vLLM's ``PrefixCacheStats`` names).

    Attributes:
        requests: admissions that looked the cache up.
        queries: tokens looked up (the admitted requests' token counts).
        hits: tokens found (``num_computed_tokens`` the admissions started with).
        hit_requests: admissions with a hit.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    hit_requests: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0 with no queries)."""
        return self.hits / self.queries if self.queries else 0.0


class SchedulerKVCacheManager(KVCacheManager):
    """``KVCacheManager`` with the scheduler's prefix-caching hooks, as no-ops (caching off)."""

    disabled_reason: str | None = "prefix caching is off"

    def get_computed_blocks(self, request) -> CacheHit:
        """No cache: always ``NO_HIT``."""
        return NO_HIT

    def allocate_slots(self, request: RequestLike, num_new_tokens: int,
                       new_computed_blocks: CacheHit | None = None) -> tuple[list[int], ...] | None:
        """``KVCacheManager.allocate_slots`` (a hit is never given without caching)."""
        return super().allocate_slots(request, num_new_tokens)

    def record_admission(self, request, hit: CacheHit) -> None:
        """Nothing to count."""

    def cache_blocks(self, request) -> None:
        """Nothing to cache."""

    def align_num_new_tokens(self, request, start: int, num_new_tokens: int) -> int:
        """Tokens to schedule from ``start`` (Mamba checkpoints cut chunks; here unchanged)."""
        return num_new_tokens

    def plan_state_copies(self, sched: dict[str, int], requests: dict) -> MambaStateCopies | None:
        """The step's Mamba state copies (none without caching)."""
        return None

    def finish_step(self) -> None:
        """A step was applied (nothing to do without caching)."""


class PrefixCachingKVCacheManager(SchedulerKVCacheManager):
    """``KVCacheManager`` with prefix caching over every group.

    Args:
        kv_cache_config: the groups and their pool sizes.
        async_scheduling, chunked_prefill: the scheduler's modes (Mamba checkpoints need
            synchronous scheduling with chunked prefill).
        mamba_block_size: ``Bm``, the Mamba checkpoint interval (tokens); default the lcm
            of the attention groups' block sizes.

    Raises:
        KVCacheSpecError: a group without a block policy or a pool under 2 blocks.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, *, async_scheduling: bool = False,
                 chunked_prefill: bool = True, mamba_block_size: int | None = None):
        super().__init__(kv_cache_config)
        self.pools = [PrefixCachingBlockPool(kv_cache_config.num_blocks_of(g))
                      for g in range(len(kv_cache_config.groups))]
        self.managers = [make_block_manager(g.kv_cache_spec, p, kv_cache_config.state_slots_per_request)
                         for g, p in zip(kv_cache_config.groups, self.pools)]
        self.specs = [g.kv_cache_spec for g in kv_cache_config.groups]
        mamba = [g for g, s in enumerate(self.specs) if isinstance(s, StateSpec)]
        bm = mamba_block_size or default_mamba_block_size(self.specs)
        # the coordinator sees a Mamba group as one checkpoint per Bm tokens
        hit_specs = [dataclasses.replace(s, block_size=bm) if g in mamba else s for g, s in enumerate(self.specs)]
        self.coordinator = HybridPrefixCoordinator(hit_specs, self.pools)
        self.mamba = MambaCheckpoints(self, mamba, bm) if mamba else None
        self.disabled_reason = None
        if mamba and (async_scheduling or not chunked_prefill):
            self.disabled_reason = ("Mamba state checkpoints need synchronous scheduling with chunked prefill "
                                    "(a chunk is cut at each checkpoint)")
        self.stats = PrefixCacheStats()
        self._hashes: dict[str, dict[int, list[BlockHash]]] = {}
        self._num_cached: dict[str, list[int]] = {}
        self._spans: dict[str, tuple] = {}  # requests with images: (offset, length, mm_hash) each

    # --- hooks --------------------------------------------------------------------------
    def get_computed_blocks(self, request) -> CacheHit:
        """The longest cached prefix valid for every group, of at most ``num_tokens - 1``
        tokens (prompt plus outputs: a resumed request may hit its own blocks). Changes
        nothing but the request's memoised hashes. ``NO_HIT`` when caching is disabled, and
        for a request given prompt embeddings (its prompt ids do not say what it holds). A
        request with images hits too: its blocks' hashes include the images' content hashes
        (``_mm_spans``), so the same placeholder ids with another image never match."""
        if self.disabled_reason is not None or getattr(request, "prompt_embeds", None) is not None:
            return NO_HIT
        tokens = request.all_token_ids
        hashes = self._block_hashes(request, tokens)
        return self.coordinator.get_computed_blocks(tokens, block_hashes=hashes)

    def allocate_slots(self, request: RequestLike, num_new_tokens: int,
                       new_computed_blocks: CacheHit | None = None) -> tuple[list[int], ...] | None:
        """``KVCacheManager.allocate_slots``, optionally starting from a prefix hit.

        Args:
            request: has ``req_id`` and ``num_computed_tokens`` (0 and no blocks when a hit
                is given).
            num_new_tokens: tokens computed this step after the hit.
            new_computed_blocks: ``get_computed_blocks``' result, or ``None``.

        Returns:
            Per group the newly allocated ids (the hit's ids not included), or ``None``
            when a pool is short; then nothing changed.

        Raises:
            SchedulingError: ``num_new_tokens < 0``, or a hit for a request that holds blocks.
        """
        hit = new_computed_blocks
        if hit is None or hit.num_computed_tokens == 0:
            return KVCacheManager.allocate_slots(self, request, num_new_tokens)
        self._num_new_tokens_ok(request, num_new_tokens)
        rid = request.req_id
        if request.num_computed_tokens or any(m.block_ids(rid) for m in self.managers):
            raise SchedulingError(f"request {rid!r}: a prefix hit is only for a request without blocks")
        total = hit.num_computed_tokens + num_new_tokens
        mamba = set(self.mamba.groups) if self.mamba else set()
        for g, (m, ids) in enumerate(zip(self.managers, hit.block_ids)):
            revived = sum(1 for b in ids if b != NULL_BLOCK_ID and not m.pool.is_allocated(b))
            held = 0 if g in mamba else len(ids)  # a Mamba hit restores a copy into a slot of its own
            if m.num_blocks_needed(total) - held > m.pool.num_free_blocks - revived:
                return None
        for g, (m, ids) in enumerate(zip(self.managers, hit.block_ids)):
            if g not in mamba:
                m.pool.touch(ids)
                m.req_to_blocks[rid] = list(ids)
        self._num_cached[rid] = [0 if g in mamba else len(ids) for g, ids in enumerate(hit.block_ids)]
        for m in self.managers:
            m.remove_skipped_blocks(rid, hit.num_computed_tokens)
        new = tuple(m.allocate_new_blocks(rid, total) for m in self.managers)
        if mamba:
            self.mamba.hold_hit(rid, {g: hit.block_ids[g][-1] for g in mamba})
        return new

    def record_admission(self, request, hit: CacheHit) -> None:
        """Count an admitted request's lookup in ``stats``."""
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += hit.num_computed_tokens
        self.stats.hit_requests += hit.num_computed_tokens > 0

    def cache_blocks(self, request) -> None:
        """Register the request's blocks that are now full and computed (after a step).

        Only tokens known on the host count (asynchronous scheduling's placeholders do not);
        a request given prompt embeddings registers nothing (its ids are placeholders).
        """
        if self.disabled_reason is not None or getattr(request, "prompt_embeds", None) is not None:
            return
        rid = request.req_id
        lists = [m.block_ids(rid) for m in self.managers]
        if not any(lists):
            return
        tokens = request.all_token_ids
        computed = min(request.num_computed_tokens, len(tokens))
        hashes = self._block_hashes(request, tokens)
        done = self._num_cached.setdefault(rid, [0] * self.num_groups)
        for g, (m, ids) in enumerate(zip(self.managers, lists)):
            if self.mamba and g in self.mamba.groups:
                continue  # checkpoints are saved by plan_state_copies
            full = min(computed // m.block_size, len(ids))
            if full > done[g]:
                m.pool.cache_full_blocks(ids, hashes[m.block_size], done[g], full)
                done[g] = full

    def free(self, request: RequestLike | str) -> None:
        """Drop one reference to each of the request's blocks, tail first, in every group."""
        rid = request if isinstance(request, str) else request.req_id
        for m in self.managers:
            blocks = m.req_to_blocks.pop(rid, None)
            if blocks:
                m.pool.free(reversed(blocks))
        self._num_cached.pop(rid, None)
        self._hashes.pop(rid, None)
        self._spans.pop(rid, None)

    def align_num_new_tokens(self, request, start: int, num_new_tokens: int) -> int:
        """Mamba groups: a chunk ends at the last checkpoint boundary inside it."""
        if self.mamba is None or self.disabled_reason is not None:
            return num_new_tokens
        return self.mamba.align(start, num_new_tokens)

    def plan_state_copies(self, sched: dict[str, int], requests: dict) -> MambaStateCopies | None:
        """The step's Mamba saves (chunks ending at a checkpoint) and restores (hits)."""
        if self.mamba is None or self.disabled_reason is not None:
            return None
        self.mamba.plan_saves(sched, requests)
        return self.mamba.take()

    def finish_step(self) -> None:
        """The step was applied: register its Mamba checkpoints, release held slots."""
        if self.mamba is not None:
            self.mamba.finish_step()

    # --- reporting ----------------------------------------------------------------------
    @property
    def num_cached_blocks_per_group(self) -> list[int]:
        return [p.num_cached_blocks for p in self.pools]

    @property
    def num_evictions_per_group(self) -> list[int]:
        return [p.num_evictions for p in self.pools]

    # --- internals ----------------------------------------------------------------------
    def _block_hashes(self, request, tokens: list[int]) -> dict[int, list[BlockHash]]:
        """The request's (or request id's: its images as last seen) block hashes, memoised."""
        if isinstance(request, str):
            rid, spans = request, self._spans.get(request, ())
        else:
            rid, spans = request.req_id, _mm_spans(request)
            if spans:
                self._spans[rid] = spans
        prev = self._hashes.get(rid)
        if prev is not None:
            # a memoised chain is a prefix of the tokens' chain only if it covers no more
            for b, chain in prev.items():
                if len(chain) > len(tokens) // b:
                    prev = None
                    break
        out = self.coordinator.block_hashes(tokens, None, prev, mm_spans=spans)
        self._hashes[rid] = out
        return out


def _mm_spans(request) -> tuple[tuple[int, int, str], ...]:
    """``(offset, length, mm_hash)`` of each of the request's images (``()`` without any):
    the blocks a span overlaps hash the image's content hash too (``block_hash.mm_extra_keys``)."""
    feats = getattr(request, "mm_features", None)
    if not feats:
        return ()
    return tuple((f.mm_position.offset, f.mm_position.length, f.mm_hash) for f in feats)


def make_kv_cache_manager(kv_cache_config: KVCacheConfig, config) -> SchedulerKVCacheManager:
    """The scheduler's block manager for ``config`` (a ``SchedulerConfig``): with prefix
    caching or without."""
    if config.enable_prefix_caching:
        return PrefixCachingKVCacheManager(kv_cache_config, async_scheduling=config.async_scheduling,
                                           chunked_prefill=config.enable_chunked_prefill)
    return SchedulerKVCacheManager(kv_cache_config)
