"""Which blocks of which group a store hit needs, and their store keys (the Redis connector's
scheduler-side arithmetic; no I/O).

A hit of ``h`` tokens (``h`` a multiple of every group's block size) after a local hit of
``local`` tokens needs, per group of block size ``B``:

* full attention: every block ``[local // B, h // B)`` (the local hit holds the earlier ones);
* a sliding window of ``W`` tokens: only the blocks the first computed query (position ``h``)
  can see, ``[max(local, max(0, h - W + 1)) // B, h // B)`` (``p - W < k <= p``,
  ``cache_groups/sliding_window.py``); earlier blocks stay unloaded (the runner nulls them);
* a Mamba group (``B`` = the Mamba block size ``Bm``): the one checkpoint at ``h``, index
  ``h // Bm - 1`` (the state after exactly ``h`` tokens).

Keys: ``{prefix}:{namespace}:g{group}:{sha256 chain hash of the block, hex}``; the chain
hash (``cache_groups/block_hash.py``) names the whole prefix up to that block, so equal
keys mean equal tokens from position 0.
"""

from __future__ import annotations

import math
from typing import Sequence

from attnplug.cache_groups.block_hash import hash_request_tokens
from attnplug.core.kv_connector import KVConnectorGroup


def needed_blocks(group: KVConnectorGroup, local: int, h: int) -> range:
    """Logical block indices of ``group`` a hit of ``h`` tokens loads (module docstring)."""
    B = group.block_size
    if group.kind == "mamba":
        return range(h // B - 1, h // B) if h > local else range(0)
    first = local
    if group.kind == "sliding_window" and group.sliding_window:
        first = max(local, max(0, h - group.sliding_window + 1))
    return range(first // B, h // B)


def hit_granularity(groups: Sequence[KVConnectorGroup]) -> int:
    """The step a hit grows by: the lcm of the groups' block sizes."""
    return math.lcm(*(g.block_size for g in groups))


class KeyChains:
    """Per block size, a request's chain hashes as store keys (memoised per token list)."""

    def __init__(self, prefix: str, namespace: str, groups: Sequence[KVConnectorGroup]):
        self.base = f"{prefix}:{namespace}"
        self.groups = groups

    def keys(self, token_ids: Sequence[int]) -> list[list[str]]:
        """Per group, the key of every full block of ``token_ids``."""
        by_size: dict[int, list[bytes]] = {}
        out = []
        for g, grp in enumerate(self.groups):
            hashes = by_size.get(grp.block_size)
            if hashes is None:
                hashes = by_size[grp.block_size] = hash_request_tokens(list(token_ids), grp.block_size)
            out.append([f"{self.base}:g{g}:{h.hex()}" for h in hashes])
        return out


def longest_hit(groups: Sequence[KVConnectorGroup], local: int, max_tokens: int,
                present: dict[tuple[int, int], bool]) -> int:
    """The largest ``h`` (a multiple of :func:`hit_granularity`, ``local < h <= max_tokens``)
    whose needed blocks are all ``present[(group, index)]``; ``local`` when there is none."""
    step = hit_granularity(groups)
    h = max_tokens // step * step
    while h > local:
        if all(present.get((g, i), False) for g, grp in enumerate(groups) for i in needed_blocks(grp, local, h)):
            return h
        h -= step
    return local
