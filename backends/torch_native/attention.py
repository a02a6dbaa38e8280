"""Paged KV-cache write and paged varlen attention, as pure torch functions.

These two functions are the whole numerical content of the ``torch_native`` backend,
the golden reference every other backend is checked against. They favour clarity over
speed: every step is a plain tensor op, softmax runs in float32.

KV-cache layout (one layer)::

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_size]
               |           |  |
               |           |  +-- offset inside the block (slot % block_size)
               |           +----- 0 = K, 1 = V
               +----------------- physical block id (slot // block_size)

A flat *slot* is ``block_id * block_size + offset`` (vLLM's convention).

Visibility of key position ``k`` to a query at position ``p`` (causal, bottom-right
aligned; ``W`` = sliding window in tokens, current token included)::

    causal:          k <= p
    sliding window:  p - W < k <= p

    W = 3, query positions 4..6 over keys 0..6 (x = visible):

              k: 0 1 2 3 4 5 6
        p = 4:   . . x x x . .
        p = 5:   . . . x x x .
        p = 6:   . . . . x x x
"""

from __future__ import annotations

import torch


def write_to_paged_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                         slots: torch.Tensor, token_indices: torch.Tensor) -> None:
    """Scatter this step's K/V into the paged cache, in place.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]``, float32/float16/bfloat16, same
            device as ``kv_cache``.
        value: same shape, dtype and device as ``key``.
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``, any float
            dtype (``key``/``value`` are cast to it).
        slots: ``[num_writes]``, ``torch.int64``, same device; flat slot indices
            (``block_id * block_size + offset``), all real (``PAD_SLOT_ID`` already
            filtered out by the builder).
        token_indices: ``[num_writes]``, ``torch.int64``, same device; which row of
            ``key``/``value`` goes to each slot.

    Only the ``num_writes`` addressed slots change; every other byte of ``kv_cache`` is
    left as it was. Does not synchronise with the host.
    """
    block_size = kv_cache.shape[2]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - block_ids * block_size
    kv_cache[block_ids, 0, offsets] = key.index_select(0, token_indices).to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value.index_select(0, token_indices).to(kv_cache.dtype)


def gather_from_paged_cache(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K and V at flat slot indices.

    Args:
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``.
        slots: any shape ``S``, ``torch.int64``, same device; flat slot indices.

    Returns:
        ``(key, value)``, each ``[*S, num_kv_heads, head_size]`` in the cache's dtype.
    """
    block_size = kv_cache.shape[2]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - block_ids * block_size
    return kv_cache[block_ids, 0, offsets], kv_cache[block_ids, 1, offsets]


def visibility_mask(query_positions: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                    causal: bool = True, sliding_window: int | None = None) -> torch.Tensor:
    """Which keys each query may attend to.

    Args:
        query_positions: ``[num_reqs, query_len]``, ``torch.int64``; the position of each
            query token within its request (``num_computed_tokens + j``).
        seq_lens: ``[num_reqs]``, ``torch.int64``, same device; keys ``0 .. seq_len - 1``
            exist for each request.
        max_seq_len: number of key columns (>= every ``seq_lens`` entry).
        causal: bottom-right aligned causal mask (key ``k`` visible iff ``k <= p``);
            ``False`` lets every query see all of its request's keys.
        sliding_window: ``W`` tokens (current included): also require ``k > p - W``.

    Returns:
        ``[num_reqs, query_len, max_seq_len]``, ``torch.bool``; True = visible.
    """
    key_pos = torch.arange(max_seq_len, device=query_positions.device)
    mask = key_pos.view(1, 1, -1) < seq_lens.view(-1, 1, 1)
    q = query_positions.unsqueeze(-1)
    if causal:
        mask = mask & (key_pos.view(1, 1, -1) <= q)
    if sliding_window is not None:
        mask = mask & (key_pos.view(1, 1, -1) > q - sliding_window)
    return mask


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
           scale: float, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Masked multi-head attention with GQA/MQA, computed in float32.

    Args:
        query: ``[num_reqs, query_len, num_heads, head_size]``.
        key, value: ``[num_reqs, max_seq_len, num_kv_heads, head_size]``;
            ``num_heads % num_kv_heads == 0``; query head ``h`` uses KV head
            ``h // (num_heads // num_kv_heads)`` (HF ``repeat_kv`` order).
        mask: ``[num_reqs, query_len, max_seq_len]``, ``torch.bool``, True = visible. Every
            query row must see at least one key (a fully masked row gives NaN).
        scale: multiplies ``q . k`` (usually ``head_size ** -0.5``).
        logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)`` after scaling
            and before masking (Gemma-2 convention).

    Returns:
        ``[num_reqs, query_len, num_heads, head_size]``, float32.

    Keys masked for every query are zeroed before use, so garbage (even NaN) in unused
    cache slots such as the null block never leaks into the result.
    """
    n, q_len, num_heads, head_size = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().reshape(n, q_len, num_kv_heads, group, head_size)
    used = mask.any(dim=1).view(n, -1, 1, 1)  # [n, max_seq_len, 1, 1]: seen by some query
    k = torch.where(used, key.float(), 0.0)
    v = torch.where(used, value.float(), 0.0)
    logits = torch.einsum("nqhgd,nkhd->nhgqk", q, k) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    logits = logits.masked_fill(~mask.view(n, 1, 1, q_len, -1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("nhgqk,nkhd->nqhgd", probs, v)
    return out.reshape(n, q_len, num_heads, head_size)
