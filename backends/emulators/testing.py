"""Test helpers for the emulators: a random paged batch and its ``torch_native`` result.

:func:`make_paged_batch` builds one step over a paged cache whose blocks hold every
request's context (permuted block ids, poisoned spare blocks); :func:`torch_native_reference`
runs the golden ``torch_native`` backend over it. Emulator tests then call an emulator
with hand-built kernel arguments and compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnplug.cache_groups.specs import FullAttentionSpec, cdiv
from attnplug.core.contracts import BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata

POISON = 1e4
"""Value of cache entries no request owns (reading them ruins the output)."""


@dataclass
class PagedBatch:
    """One step over a paged cache (all tensors on CPU).

    Attributes:
        cm: the step's common metadata (``block_table_tensor`` in ``block_size`` blocks).
        query: ``[num_tokens, num_heads, head_size]``.
        key, value: ``[num_tokens, num_kv_heads, head_size]``: the step's K/V (already in the cache).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        block_ids: per request, its blocks in order.
    """

    cm: CommonAttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_ids: list[list[int]]
    block_size: int

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2]

    @property
    def head_size(self) -> int:
        return self.query.shape[2]


def make_paged_batch(num_computed: list[int], num_scheduled: list[int], block_size: int, *, num_heads: int = 4,
                     num_kv_heads: int = 2, head_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
                     spare_blocks: int = 2, shared_prefix_blocks: int = 0) -> PagedBatch:
    """A random step: request ``i`` has ``num_computed[i]`` cached tokens and schedules
    ``num_scheduled[i]``; its first ``shared_prefix_blocks`` blocks are the same physical
    blocks for every request (a common prefix)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    seq_lens = [c + s for c, s in zip(num_computed, num_scheduled)]
    need = [cdiv(n, block_size) for n in seq_lens]
    own = [n - shared_prefix_blocks for n in need]
    total = shared_prefix_blocks + sum(own) + spare_blocks
    ids = rng.permutation(np.arange(1, total + 1)).tolist()
    shared, ids = ids[:shared_prefix_blocks], ids[shared_prefix_blocks:]
    block_ids, at = [], 0
    for n in own:
        block_ids.append(shared + ids[at:at + n])
        at += n
    width = max(need)
    table = [row + [0] * (width - len(row)) for row in block_ids]
    cm = CommonAttentionMetadata.from_lengths(num_computed, num_scheduled, table, block_size)
    shape = (total + 1, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, POISON, dtype=dtype)
    value_cache = torch.full(shape, POISON, dtype=dtype)
    for i, (blocks, n) in enumerate(zip(block_ids, seq_lens)):  # shared blocks get the same values each time
        pos = torch.arange(n)
        blk = torch.as_tensor(blocks)[pos // block_size]
        kk = torch.randn(n, num_kv_heads, head_size, generator=torch.Generator().manual_seed(1000 + 31 * seed + i))
        vv = torch.randn(n, num_kv_heads, head_size, generator=torch.Generator().manual_seed(2000 + 31 * seed + i))
        keep = pos >= shared_prefix_blocks * block_size
        prefix_k = torch.randn(n, num_kv_heads, head_size, generator=torch.Generator().manual_seed(7))
        prefix_v = torch.randn(n, num_kv_heads, head_size, generator=torch.Generator().manual_seed(8))
        kk = torch.where(keep.view(-1, 1, 1), kk, prefix_k)
        vv = torch.where(keep.view(-1, 1, 1), vv, prefix_v)
        key_cache[blk, pos % block_size] = kk.to(dtype)
        value_cache[blk, pos % block_size] = vv.to(dtype)
    slots = cm.slot_mapping
    key = key_cache.flatten(0, 1)[slots].clone()
    value = value_cache.flatten(0, 1)[slots].clone()
    query = torch.randn(cm.num_actual_tokens, num_heads, head_size, generator=g).to(dtype)
    return PagedBatch(cm, query, key, value, key_cache, value_cache, block_ids, block_size)


def torch_native_reference(batch: PagedBatch, scale: float | None = None, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> torch.Tensor:
    """The ``torch_native`` output of ``batch``: ``[num_tokens, num_heads, head_size]``."""
    from attnplug.backends.torch_native import TorchNativeBackend

    scale = batch.head_size ** -0.5 if scale is None else scale
    spec = FullAttentionSpec(block_size=batch.block_size, num_kv_heads=batch.num_kv_heads, head_size=batch.head_size,
                             dtype=batch.key_cache.dtype)
    n = batch.cm.num_reqs
    builder = TorchNativeBackend.get_builder_cls()(spec, ["l"], BuilderConfig(n, batch.cm.num_actual_tokens,
                                                                               batch.cm.max_seq_len), "cpu")
    impl = TorchNativeBackend.get_impl_cls()(batch.num_heads, batch.head_size, scale, batch.num_kv_heads,
                                             sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    kv_cache = torch.stack([batch.key_cache, batch.value_cache], dim=1)
    out = torch.zeros_like(batch.query)
    impl.forward(None, batch.query, batch.key, batch.value, kv_cache, builder.build(0, batch.cm), out)
    return out
