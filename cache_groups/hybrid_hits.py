"""Prefix-cache hits for hybrid models: one coordinator over every cache group.

A hit of ``h`` tokens lets a new request start with ``num_computed_tokens = h``: each
group must be able to restore what the request's later queries read. The rule per group
kind (block size ``B`` of that group; ``cached[i]`` is the pool's block for the group's
logical block ``i`` under the request's hash chain, or ``None``):

* full attention — every query sees every earlier key: blocks ``0 .. h/B - 1`` all cached.
* sliding window ``W`` — a query at ``p >= h`` sees keys from ``p - W + 1`` on, so only the
  ``cdiv(W - 1, B)`` blocks before ``h`` must be cached; earlier logical blocks are
  ``NULL_BLOCK_ID`` in the hit (they would be skipped anyway, ``cache_groups/sliding_window.py``).
* Mamba2 — the state is a checkpoint stored only at exact multiples of the group's block
  size ``Bm`` (block ``i`` holds the conv and SSM state after tokens ``0 .. (i+1)*Bm - 1``),
  so ``h`` is a multiple of ``Bm`` and only block ``h/Bm - 1`` must be cached; the earlier
  checkpoints are ``NULL_BLOCK_ID``.

The hit is the longest ``h`` valid for every group at once (each group its own rule: two
sliding-window groups with different windows each check their own ``W``). Validity is not
monotone in ``h`` for sliding windows and Mamba (a longer hit can be valid while a
shorter one is not, since they need different blocks), so :func:`find_longest_cache_hit`
iterates ``h <- min_g longest_g(h)`` — each group's longest valid hit at most ``h`` — to a
fixed point, where every group is valid at ``h``; ``h`` is then a multiple of every
group's block size. At most ``num_tokens - 1`` tokens hit, so the step still computes the
last prompt token and samples from it (vLLM's ``max_cache_hit_length``).

The serving scheduler's ``KVCacheManager`` (``runner/serve/kv_cache_manager.py``) calls
:meth:`HybridPrefixCoordinator.get_computed_blocks` at admission (docs/architecture.md,
"Prefix caching"). With prefix caching a Mamba group's block size is the checkpoint
interval and its table holds one block per ``Bm`` tokens; ``MambaStateManager`` (one slot
per request) is the no-caching mode. Names follow vLLM V1's ``KVCacheCoordinator.find_longest_cache_hit`` /
``get_computed_blocks`` (semantics only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from attnplug.cache_groups.block_hash import BlockHash, hash_request_tokens, mm_extra_keys
from attnplug.cache_groups.prefix_cache import PrefixCachingBlockPool
from attnplug.cache_groups.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, StateSpec, cdiv
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import KVCacheSpecError, SchedulingError

Cached = Sequence[int | None]


# --- one group's rule: the longest valid hit of at most `max_num_blocks` blocks -------------
def full_attention_hit(cached: Cached, max_num_blocks: int) -> list[int]:
    """Longest run of cached blocks from block 0, at most ``max_num_blocks`` long.

    Returns:
        The hit's block ids (its length ``k``: a hit of ``k * B`` tokens).
    """
    out = []
    for i in range(min(max_num_blocks, len(cached))):
        if cached[i] is None:
            break
        out.append(int(cached[i]))
    return out


def sliding_window_hit(cached: Cached, max_num_blocks: int, sliding_window: int, block_size: int) -> list[int]:
    """Largest ``k <= max_num_blocks`` with blocks ``max(0, k - cdiv(W - 1, B)) .. k - 1`` cached.

    Returns:
        ``k`` ids: ``NULL_BLOCK_ID`` for the blocks before the window, then the cached ones.

    Raises:
        KVCacheSpecError: ``sliding_window`` or ``block_size`` is not positive.
    """
    if sliding_window < 1 or block_size < 1:
        raise KVCacheSpecError(f"sliding_window ({sliding_window}) and block_size ({block_size}) must be >= 1")
    need = cdiv(sliding_window - 1, block_size)
    top = min(max_num_blocks, len(cached))
    if need == 0:  # W == 1: a query sees only itself
        return [NULL_BLOCK_ID] * top
    run = 0
    for j in range(top - 1, -1, -1):  # scanning down: run = cached blocks j, j+1, ...
        run = run + 1 if cached[j] is not None else 0
        if run == need or (j == 0 and run > 0):
            k = j + run
            return [NULL_BLOCK_ID] * j + [int(cached[i]) for i in range(j, k)]
    return []


def mamba_hit(cached: Cached, max_num_blocks: int) -> list[int]:
    """Largest ``k <= max_num_blocks`` whose checkpoint (block ``k - 1``) is cached.

    Returns:
        ``k`` ids: ``NULL_BLOCK_ID`` for the earlier checkpoints, then block ``k - 1``'s id.
    """
    for k in range(min(max_num_blocks, len(cached)), 0, -1):
        if cached[k - 1] is not None:
            return [NULL_BLOCK_ID] * (k - 1) + [int(cached[k - 1])]
    return []


def group_hit(spec: KVCacheSpec, cached: Cached, max_num_blocks: int) -> list[int]:
    """The rule of ``spec``'s kind (dispatch on its type).

    Raises:
        KVCacheSpecError: a spec type without a prefix-hit rule.
    """
    if isinstance(spec, SlidingWindowSpec):
        return sliding_window_hit(cached, max_num_blocks, spec.sliding_window, spec.block_size)
    if isinstance(spec, FullAttentionSpec):
        return full_attention_hit(cached, max_num_blocks)
    if isinstance(spec, StateSpec):
        return mamba_hit(cached, max_num_blocks)
    raise KVCacheSpecError(f"no prefix-cache hit rule for {type(spec).__name__}; supported: "
                           "FullAttentionSpec, SlidingWindowSpec, StateSpec")


# --- the coordinator --------------------------------------------------------------------
@dataclass(frozen=True)
class CacheHit:
    """A prefix hit valid for every group.

    Attributes:
        num_computed_tokens: ``h``, tokens the request need not compute (multiple of every
            group's block size).
        block_ids: per group, ``h / B_g`` ids (``NULL_BLOCK_ID`` where the group reads
            nothing), the start of the request's block list there.
    """

    num_computed_tokens: int
    block_ids: tuple[tuple[int, ...], ...]


def find_longest_cache_hit(specs: Sequence[KVCacheSpec], cached_per_group: Sequence[Cached],
                           max_length: int) -> CacheHit:
    """The longest prefix of at most ``max_length`` tokens valid for every group.

    Args:
        specs: per group, its spec.
        cached_per_group: per group, ``cached[i]`` = the pool's block cached for logical
            block ``i`` of the request (``None``: not cached), one entry per full block of
            the request's tokens; a group's hit never goes past its list (not even a
            one-token window's, which needs no cached block).
        max_length: tokens, ``>= 0`` (``num_tokens - 1`` at admission).

    Returns:
        The :class:`CacheHit` (``num_computed_tokens == 0`` and empty lists on a miss).

    Raises:
        KVCacheSpecError: ``specs`` and ``cached_per_group`` differ in length, no groups,
            or a spec without a rule.
        SchedulingError: ``max_length < 0``.
    """
    if len(specs) != len(cached_per_group) or not specs:
        raise KVCacheSpecError(f"{len(specs)} specs for {len(cached_per_group)} groups' lookups")
    if max_length < 0:
        raise SchedulingError(f"max_length must be >= 0, got {max_length}")
    h = max_length
    while True:
        hits = [group_hit(s, c, h // s.block_size) for s, c in zip(specs, cached_per_group)]
        lengths = [len(ids) * s.block_size for ids, s in zip(hits, specs)]
        new_h = min(lengths)
        if all(n == new_h for n in lengths):
            return CacheHit(new_h, tuple(tuple(ids) for ids in hits))
        h = new_h  # strictly smaller: some group could not restore the old h


class HybridPrefixCoordinator:
    """Finds a request's prefix hit across every group's :class:`PrefixCachingBlockPool`.

    Groups of equal block size share one hash chain (the hashes depend on tokens, salt and
    block size only); each group looks them up in its own pool.

    Args:
        specs: per group, its spec.
        pools: per group, its pool (same order).

    Raises:
        KVCacheSpecError: the lists differ in length or are empty.
    """

    def __init__(self, specs: Sequence[KVCacheSpec], pools: Sequence[PrefixCachingBlockPool]):
        if len(specs) != len(pools) or not specs:
            raise KVCacheSpecError(f"{len(specs)} specs for {len(pools)} pools")
        self.specs = tuple(specs)
        self.pools = tuple(pools)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | bytes | None = None,
                     prev: dict[int, list[BlockHash]] | None = None,
                     mm_spans: Sequence[tuple[int, int, str]] = ()) -> dict[int, list[BlockHash]]:
        """Per distinct block size, the hash chain of the full blocks of ``token_ids``.

        ``prev`` (an earlier result for the same request) makes it incremental;
        ``mm_spans``: ``(offset, length, mm_hash)`` of the request's images, whose hashes
        enter the blocks their spans overlap (:func:`mm_extra_keys`).
        """
        prev = prev or {}
        n = len(token_ids)
        return {b: hash_request_tokens(token_ids, b, cache_salt, prev.get(b, ()),
                                       mm_extra_keys(mm_spans, b, n // b) if mm_spans else None)
                for b in sorted({s.block_size for s in self.specs})}

    def get_computed_blocks(self, token_ids: Sequence[int], cache_salt: str | bytes | None = None,
                            block_hashes: dict[int, list[BlockHash]] | None = None) -> CacheHit:
        """The longest cached prefix of a new request (vLLM's ``get_computed_blocks``).

        Changes nothing: the caller ``touch``es ``hit.block_ids[g]`` in pool ``g`` when it
        admits the request, before allocating anything else.

        Args:
            token_ids: the request's tokens (``>= 1``).
            cache_salt: the request's salt.
            block_hashes: :meth:`block_hashes` of these tokens and salt, if computed already.

        Returns:
            A :class:`CacheHit` of at most ``len(token_ids) - 1`` tokens.

        Raises:
            SchedulingError: no tokens.
        """
        if len(token_ids) == 0:
            raise SchedulingError("get_computed_blocks: a request has at least one token")
        hashes = block_hashes if block_hashes is not None else self.block_hashes(token_ids, cache_salt)
        max_length = len(token_ids) - 1
        cached = []
        for s, p in zip(self.specs, self.pools):
            chain = hashes[s.block_size][:max_length // s.block_size]
            cached.append([p.get_cached_block(x) for x in chain])
        return find_longest_cache_hit(self.specs, cached, max_length)
