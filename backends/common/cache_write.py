"""Write K/V into a paged cache at a slot mapping with plain torch ops (graph-safe).

Padded tokens carry ``PAD_SLOT_ID`` and must write nothing. Dropping them would need a
data-dependent size (``nonzero``: a host sync, and no CUDA graph); instead each padded
token is redirected to the first slot of the null block (``NULL_BLOCK_ID``, which no
request owns) and writes back the value that slot already holds. Every padded token
therefore writes the same bytes that were there: no byte of the cache changes for it,
the op has fixed shapes, and it never synchronises with the host.
"""

from __future__ import annotations

import torch

from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.errors import MetadataError
from attnplug.core.kv_quant import quantize_kv


def write_kv_by_slot(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatter each token's K and V to its slot of the paged cache, in place.

    Args:
        key: ``[>= num_tokens, num_kv_heads, head_size]``, float32/float16/bfloat16, on the
            cache's device; row ``t`` goes to ``slot_mapping[t]`` (rows past
            ``num_tokens`` are ignored). Cast to the cache's dtype.
        value: same shape, dtype and device as ``key``.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` (any strides, e.g. a
            ``split_kv_cache`` view); block ``NULL_BLOCK_ID`` must exist.
        value_cache: same shape as ``key_cache``.
        slot_mapping: ``[num_tokens]``, ``torch.int64``, same device; flat slot
            ``block_id * block_size + offset``; ``PAD_SLOT_ID`` = write nothing. Real slots
            must be distinct and outside the null block.
        k_scale, v_scale: float32 ``[]`` or ``[num_kv_heads]``, or ``None`` (1.0): an fp8
            cache stores ``saturate(x / scale)`` (``core/kv_quant.py``); other caches ignore
            them.

    Raises:
        MetadataError: shapes or dtypes that disagree (nothing is written then).

    Only the real tokens' slots change. Does not synchronise with the host; may be
    captured in a CUDA graph (all shapes depend only on ``slot_mapping.shape``).

    Examples:
        >>> import torch
        >>> kc, vc = torch.zeros(3, 4, 1, 2), torch.zeros(3, 4, 1, 2)
        >>> k = torch.ones(3, 1, 2)
        >>> write_kv_by_slot(k, k, kc, vc, torch.tensor([5, -1, 11]))
        >>> kc.flatten(1).sum(1).tolist()   # block 1 offset 1 and block 2 offset 3; block 0 untouched
        [0.0, 2.0, 2.0]
    """
    n = slot_mapping.shape[0]
    num_blocks, block_size = key_cache.shape[:2]
    if (slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64 or key.shape[0] < n
            or key.shape[1:] != key_cache.shape[2:] or value.shape != key.shape
            or value_cache.shape != key_cache.shape or num_blocks <= NULL_BLOCK_ID):
        raise MetadataError(
            f"write_kv_by_slot: key {tuple(key.shape)}, value {tuple(value.shape)}, key_cache "
            f"{tuple(key_cache.shape)}, value_cache {tuple(value_cache.shape)}, slot_mapping "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}: need int64 slot_mapping [num_tokens], key/value "
            "[>= num_tokens, num_kv_heads, head_size] matching caches [num_blocks, block_size, num_kv_heads, "
            "head_size] that include the null block")
    if n == 0:
        return
    real = slot_mapping != PAD_SLOT_ID
    slots = torch.where(real, slot_mapping, torch.full_like(slot_mapping, NULL_BLOCK_ID * block_size))
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    keep = real.view(n, 1, 1)
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        new = torch.where(keep, quantize_kv(src[:n], scale, cache.dtype), cache[blocks, offsets])
        cache.index_put_((blocks, offsets), new)
