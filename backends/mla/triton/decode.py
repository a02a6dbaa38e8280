"""``mla_decode``: the Python entry point of the Triton MLA decode kernel.

Launches ``mla_decode_kernel`` over (decodes, head blocks, ``num_kv_splits``) and
combines the splits' partials by their log-sum-exp (a few torch ops on
``[num_decodes, num_heads, num_kv_splits]``; no host synchronisation).
"""

from __future__ import annotations

import torch

from attnplug.backends.triton.runtime import kernel_module, launch
from attnplug.core.errors import MetadataError

BLOCK_N = 16
"""Keys per inner iteration of the decode kernel."""


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, int(n) - 1).bit_length())


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               *, kv_lora_rank: int, scale: float, num_kv_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: one query per request over its latent rows ``0 .. seq_len - 1``.

    Args:
        q: ``[num_decodes, num_heads, kv_lora_rank + rope]``, the cache's dtype; last dim contiguous.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]``, last dim contiguous.
        block_table: ``[num_decodes, >= cdiv(max(seq_lens), block_size)]``, ``torch.int32``.
        seq_lens: ``[num_decodes]``, ``torch.int32``, each >= 1.
        kv_lora_rank: ``L``: the first ``L`` values of a row are the value.
        scale: softmax scale.
        num_kv_splits: key splits per request (>= 1).

    Returns:
        ``(o, lse)``: ``[num_decodes, num_heads, L]`` in ``q``'s dtype and ``[num_heads,
        num_decodes]`` float32 (natural log).

    Raises:
        MetadataError: shapes or dtypes the kernel cannot take (nothing is launched).
    """
    b, n_heads, width = q.shape
    if (kv_cache.dim() != 3 or kv_cache.shape[2] != width or kv_cache.dtype != q.dtype or width <= kv_lora_rank
            or block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or num_kv_splits < 1
            or q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_table.shape[0] < b or seq_lens.shape[0] < b):
        raise MetadataError(f"mla_decode: q {tuple(q.shape)} {q.dtype}, kv_cache {tuple(kv_cache.shape)} "
                            f"{kv_cache.dtype}, block_table {block_table.dtype} {tuple(block_table.shape)}, seq_lens "
                            f"{seq_lens.dtype} {tuple(seq_lens.shape)}, num_kv_splits {num_kv_splits}: need rows of "
                            f"kv_lora_rank {kv_lora_rank} + rope, one dtype, int32 metadata")
    rope = width - kv_lora_rank
    l_pad, r_pad = _pow2(kv_lora_rank), _pow2(rope)
    block_h = min(64, _pow2(n_heads))
    acc = torch.empty(b, n_heads, num_kv_splits, l_pad, dtype=torch.float32, device=q.device)
    mx = torch.empty(b, n_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    sm = torch.empty_like(mx)
    if b:
        launch(kernel_module("mla_decode_kernels"), "mla_decode_kernel", (b, -(-n_heads // block_h), num_kv_splits),
               q, kv_cache, block_table, seq_lens, acc, mx, sm, n_heads, float(scale),
               q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
               KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope, L_PAD=l_pad, R_PAD=r_pad, BLOCK_SIZE=kv_cache.shape[1],
               BLOCK_H=block_h, BLOCK_N=BLOCK_N, NUM_SPLITS=num_kv_splits,
               DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return combine_splits(acc[..., :kv_lora_rank], mx, sm, q.dtype)


def combine_splits(acc: torch.Tensor, mx: torch.Tensor, sm: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise split partials: ``acc`` ``[B, N, S, L]``, ``mx``/``sm`` ``[B, N, S]`` ->
    ``(o [B, N, L], lse [N, B])``. An empty split (``mx = -inf``) weighs 0."""
    top = mx.max(-1, keepdim=True).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(mx - top) * sm                                            # [B, N, S]
    total = w.sum(-1)
    o = (torch.exp(mx - top).unsqueeze(-1) * acc).sum(-2) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    lse = torch.log(total) + top.squeeze(-1)
    return o.to(dtype), lse.transpose(0, 1).contiguous()
