"""Shared by the builder tests of speculative decoding: steps whose verifying rows have
query length ``1 + k`` (among one-token decodes and a prefill), and an independent dense
reference (positions, causal bottom-right, sliding window, GQA written out per token)."""

from __future__ import annotations

import torch

from attnplug.backends.emulators.testing import PagedBatch, make_paged_batch
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.contracts import BuilderConfig

# (num_computed, num_scheduled): decodes first (a reorder_batch_threshold = 1 builder's
# order), then verifying rows of 1 + 3 and 1 + 2 tokens, then a prefill.
CASES = {
    "verify-mixed": ([12, 3, 7, 9, 0], [1, 1, 4, 3, 6]),
    "verify-only": ([5, 10, 2], [4, 4, 2]),
}


def dense_reference(b: PagedBatch, window: int | None = None) -> torch.Tensor:
    """Token ``t`` of request ``i`` at position ``p`` attends keys ``max(0, p - W + 1) .. p``
    (``W`` = ``window``, else all), read from the cache at the request's blocks."""
    cm = b.cm
    out = torch.zeros_like(b.query)
    qsl, seq = cm.query_start_loc_cpu.tolist(), cm.seq_lens_cpu.tolist()
    H, Hkv = b.num_heads, b.num_kv_heads
    scale = b.head_size ** -0.5
    for i, blocks in enumerate(b.block_ids):
        q_len = qsl[i + 1] - qsl[i]
        for j in range(q_len):
            p = seq[i] - q_len + j
            lo = 0 if window is None else max(0, p - window + 1)
            pos = torch.arange(lo, p + 1)
            blk = torch.as_tensor(blocks)[pos // b.block_size]
            k = b.key_cache[blk, pos % b.block_size].float()       # [n, Hkv, D]
            v = b.value_cache[blk, pos % b.block_size].float()
            q = b.query[qsl[i] + j].float()                          # [H, D]
            kk = k.repeat_interleave(H // Hkv, dim=1)                # [n, H, D]
            vv = v.repeat_interleave(H // Hkv, dim=1)
            w = torch.softmax(torch.einsum("hd,nhd->hn", q, kk) * scale, dim=-1)
            out[qsl[i] + j] = torch.einsum("hn,nhd->hd", w, vv).to(out.dtype)
    return out


def run_backend(backend, b: PagedBatch, window: int | None = None) -> torch.Tensor:
    """One build + forward of ``backend`` over ``b`` (its own cache layout)."""
    kw = dict(block_size=b.block_size, num_kv_heads=b.num_kv_heads, head_size=b.head_size, dtype=b.key_cache.dtype)
    spec = SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)
    builder = backend.get_builder_cls()(spec, ["l0"], BuilderConfig(8, 64, 256), "cpu")
    impl = backend.get_impl_cls()(b.num_heads, b.head_size, b.head_size ** -0.5, b.num_kv_heads,
                                  sliding_window=window)
    nb = b.key_cache.shape[0]
    shape = tuple(backend.get_kv_cache_shape(nb, b.block_size, b.num_kv_heads, b.head_size))
    kv = torch.stack([b.key_cache, b.value_cache], dim=0 if shape[0] == 2 else 1)
    assert tuple(kv.shape) == shape, (kv.shape, shape)
    out = torch.zeros_like(b.query)
    impl.forward(None, b.query, b.key, b.value, kv, builder.build(0, b.cm), out)
    return out


def batch(case: str, block_size: int = 4, seed: int = 3) -> PagedBatch:
    nc, ns = CASES[case]
    return make_paged_batch(nc, ns, block_size, seed=seed)
