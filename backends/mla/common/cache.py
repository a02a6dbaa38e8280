"""Writing and reading the MLA latent cache with plain torch ops (graph-safe).

One row per token: ``[kv_c_normed (kv_lora_rank) | k_pe (qk_rope_head_dim)]`` (vLLM's
``concat_and_cache_mla``). Padded tokens (``PAD_SLOT_ID``) are redirected to slot 0 of
the null block and write back what it holds (as ``backends/common/cache_write.py`` does for
K/V): fixed shapes, no host synchronisation, no byte of the cache changes for them.
"""

from __future__ import annotations

import torch

from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.errors import MetadataError


def concat_and_cache_mla(kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Write each token's latent row ``[kv_c_normed | k_pe]`` to its slot, in place.

    Args:
        kv_c_normed: ``[>= num_tokens, kv_lora_rank]``, float; the latent after its RMSNorm.
        k_pe: ``[>= num_tokens, qk_rope_head_dim]`` or ``[>= num_tokens, 1, qk_rope_head_dim]``,
            rotated.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``; values are
            cast to its dtype.
        slot_mapping: ``[num_tokens]``, ``torch.int64``; ``block_id * block_size + offset``,
            ``PAD_SLOT_ID`` = write nothing.

    Raises:
        MetadataError: shapes or dtypes that disagree (nothing is written then).
    """
    n = slot_mapping.shape[0]
    if k_pe.dim() == 3:
        k_pe = k_pe.squeeze(1)
    if (kv_cache.dim() != 3 or slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64
            or kv_c_normed.shape[0] < n or k_pe.shape[0] < n
            or kv_c_normed.shape[-1] + k_pe.shape[-1] != kv_cache.shape[2] or kv_cache.shape[0] <= NULL_BLOCK_ID):
        raise MetadataError(
            f"concat_and_cache_mla: kv_c_normed {tuple(kv_c_normed.shape)}, k_pe {tuple(k_pe.shape)}, kv_cache "
            f"{tuple(kv_cache.shape)}, slot_mapping {slot_mapping.dtype} {tuple(slot_mapping.shape)}: need int64 "
            "slot_mapping [num_tokens] and rows kv_lora_rank + qk_rope_head_dim == kv_cache.shape[2]")
    if n == 0:
        return
    rows = kv_cache.view(-1, kv_cache.shape[2])
    real = slot_mapping != PAD_SLOT_ID
    slots = torch.where(real, slot_mapping, torch.full_like(slot_mapping, NULL_BLOCK_ID * kv_cache.shape[1]))
    new = torch.cat([kv_c_normed[:n], k_pe[:n]], dim=-1).to(kv_cache.dtype)
    rows.index_put_((slots,), torch.where(real.unsqueeze(1), new, rows[slots]))


def gather_latent(kv_cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The latent rows at ``slots``: ``[len(slots), kv_lora_rank + qk_rope_head_dim]``.

    Args:
        kv_cache: ``[num_blocks, block_size, row]``.
        slots: ``[n]``, ``torch.int64``, real slots only.
        out: optional ``[>= n, row]`` workspace of the cache's dtype; its first ``n`` rows are
            written and returned (a view).
    """
    rows = kv_cache.view(-1, kv_cache.shape[2])
    if out is None:
        return rows.index_select(0, slots)
    dst = out[: slots.shape[0]]
    torch.index_select(rows, 0, slots, out=dst)
    return dst
