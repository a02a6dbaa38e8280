"""Python entry points of the sparse Triton kernels (``backends/triton/sparse_kernels.py``).

Both validate shapes and dtypes first (``MetadataError``, nothing launched) and never
synchronise with the host.
"""

from __future__ import annotations

import torch

from attnplug.backends.triton.runtime import kernel_module, launch
from attnplug.core.errors import MetadataError
from attnplug.core.sparse import SelectorMetadata

BLOCK_N = 16
"""Keys (selector) or selected slots (consumer) per inner tile."""


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, int(n) - 1).bit_length())


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, md: SelectorMetadata,
                   num_tokens: int, scale: float) -> torch.Tensor:
    """``[num_tokens, S]`` float32 (``S = md.ranges.max_key_len``): ``sum_h w relu(scale q_h . k)``
    for each visible position, ``-inf`` elsewhere.

    Args:
        q: ``[>= num_tokens, H, D]`` in the cache dtype; weights ``[>= num_tokens, H]`` float32.
        kv_cache: ``[num_blocks, block_size, D]``.

    Raises:
        MetadataError: shapes / dtypes the kernel cannot take.
    """
    h, d = q.shape[1], q.shape[2]
    if (kv_cache.dim() != 3 or kv_cache.shape[2] != d or q.dtype != kv_cache.dtype or weights.dtype != torch.float32
            or q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or md.block_table.dtype != torch.int32):
        raise MetadataError(f"indexer_scores: q {tuple(q.shape)} {q.dtype}, weights {weights.dtype}, kv_cache "
                            f"{tuple(kv_cache.shape)} {kv_cache.dtype}: need one dtype, float32 weights, rows of D")
    s = md.ranges.max_key_len
    scores = torch.empty(num_tokens, s, dtype=torch.float32, device=q.device)
    if num_tokens and s:
        r = md.ranges
        launch(kernel_module("sparse_kernels"), "indexer_scores_kernel", (num_tokens, -(-s // BLOCK_N)),
               q, weights.contiguous(), kv_cache, md.block_table, r.req_of_token, r.key_start, r.key_end, scores, s,
               float(scale), q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
               md.block_table.stride(0), NUM_HEADS=h, HEAD_DIM=d, H_PAD=_pow2(h), D_PAD=_pow2(d),
               BLOCK_SIZE=kv_cache.shape[1], BLOCK_N=BLOCK_N, DOT_PRECISION=_precision(q.dtype))
    return scores


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, *, kv_lora_rank: int,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed sparse MLA: each query over the latent rows at its ``slots`` (``-1``: none).

    Args:
        q: ``[T, N, L + R]``, the cache dtype, last dim contiguous.
        kv_cache: ``[num_blocks, block_size, L + R]``, contiguous.
        slots: ``[T, K]`` int64 flat rows of ``kv_cache.view(-1, L + R)``.

    Returns:
        ``(o [T, N, L] in q's dtype, lse [N, T] float32)``; a query with no slot: zeros, ``-inf``.

    Raises:
        MetadataError: shapes / dtypes the kernel cannot take.
    """
    t, n, width = q.shape
    if (kv_cache.dim() != 3 or kv_cache.shape[2] != width or kv_cache.dtype != q.dtype or width <= kv_lora_rank
            or slots.dtype != torch.int64 or slots.dim() != 2 or slots.shape[0] < t or q.stride(-1) != 1
            or not kv_cache.is_contiguous()):
        raise MetadataError(f"sparse_mla: q {tuple(q.shape)} {q.dtype}, kv_cache {tuple(kv_cache.shape)} "
                            f"{kv_cache.dtype}, slots {slots.dtype} {tuple(slots.shape)}: need one dtype, rows of "
                            f"kv_lora_rank {kv_lora_rank} + rope, int64 slots [T, K], a contiguous cache")
    rope, k = width - kv_lora_rank, slots.shape[1]
    l_pad = _pow2(kv_lora_rank)
    block_h = min(64, _pow2(n))
    o = torch.empty(t, n, l_pad, dtype=torch.float32, device=q.device)
    lse = torch.empty(n, t, dtype=torch.float32, device=q.device)
    if t:
        rows = kv_cache.view(-1, width)
        launch(kernel_module("sparse_kernels"), "sparse_mla_kernel", (t, -(-n // block_h)),
               q, rows, slots, o, lse, n, t, float(scale), q.stride(0), q.stride(1), rows.stride(0), slots.stride(0),
               TOPK=k, KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope, L_PAD=l_pad, R_PAD=_pow2(rope), BLOCK_H=block_h,
               BLOCK_N=BLOCK_N, DOT_PRECISION=_precision(q.dtype))
    return o[..., :kv_lora_rank].to(q.dtype), lse
