"""Paged KV-cache write and paged varlen attention, as pure torch functions.

These functions are the whole numerical content of the ``torch_native`` backend, the
golden reference every other backend is checked against: write K/V at slots
(:func:`write_to_paged_cache`), read a request's blocks back
(:func:`gather_from_paged_cache`), say which keys each query sees
(:func:`visibility_mask`), and attend (:func:`attend`). They favour clarity over speed:
every step is a plain tensor op; logits, softmax and the weighted sum run in float32.

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

    W = 3, query positions 4..6 over keys 0..6 (x = visible, . = masked):

              k: 0 1 2 3 4 5 6
        p = 4:   . . x x x . .
        p = 5:   . . . x x x .
        p = 6:   . . . . x x x
"""

from __future__ import annotations

import torch

from attnplug.backends.common.sinks import softmax_with_sinks
from attnplug.core.kv_quant import dequantize_kv, is_quantized, quantize_kv


def write_to_paged_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                         slots: torch.Tensor, token_indices: torch.Tensor,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
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
        k_scale, v_scale: float32 ``[]`` or ``[num_kv_heads]`` (``core/kv_quant.py``), or
            ``None`` (1.0); used only by an fp8 cache, which stores ``saturate(x / scale)``.

    Only the ``num_writes`` addressed slots change; every other byte of ``kv_cache`` is
    left as it was. Does not synchronise with the host.
    """
    block_size = kv_cache.shape[2]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - block_ids * block_size
    kv_cache[block_ids, 0, offsets] = quantize_kv(key.index_select(0, token_indices), k_scale, kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = quantize_kv(value.index_select(0, token_indices), v_scale, kv_cache.dtype)


def gather_from_paged_cache(kv_cache: torch.Tensor, block_ids: torch.Tensor, key_used: torch.Tensor,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read whole blocks through a block table into K and V copies, tokens in order.

    Args:
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``.
        block_ids: ``[num_reqs, num_blocks_per_req]``, ``torch.int64``, same device;
            physical block ids in logical order (rows of the block table).
        key_used: ``[num_reqs, num_blocks_per_req * block_size]``, ``torch.bool``; False
            where no query will see the key (past ``seq_len``, before every window, null
            block). Those values are zeroed in the copy, so garbage, even NaN, cannot
            leak through ``0 * value`` (their logits are masked to ``-inf``).
        k_scale, v_scale: an fp8 cache's scales (``core/kv_quant.py``; ``None`` = 1.0).

    Returns:
        ``(key, value)``, each ``[num_reqs, num_blocks_per_req * block_size, num_kv_heads,
        head_size]``, contiguous, in the cache's dtype (an fp8 cache: dequantised,
        ``stored * scale`` in float32): key position ``k`` of request ``r`` is ``[r, k]``.
        Fresh copies: the cache is not aliased.
    """
    n, num_blocks_per_req = block_ids.shape
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    shape = (n, num_blocks_per_req * block_size, num_kv_heads, head_size)
    flat_ids = block_ids.flatten()
    key = kv_cache[:, 0].index_select(0, flat_ids).view(shape)  # whole blocks: contiguous copies
    value = kv_cache[:, 1].index_select(0, flat_ids).view(shape)
    if is_quantized(kv_cache.dtype):
        key, value = dequantize_kv(key, k_scale, torch.float32), dequantize_kv(value, v_scale, torch.float32)
    value.masked_fill_(~key_used.view(n, -1, 1, 1), 0.0)
    return key, value


def keys_used(seq_lens: torch.Tensor, query_len: int, num_keys: int,
              sliding_window: int | None = None, key_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Which key columns at least one query of the request sees.

    Args:
        seq_lens: ``[num_reqs]``, ``torch.int64``; every request has ``query_len`` queries
            at positions ``seq_len - query_len .. seq_len - 1``.
        query_len: queries per request (tokens).
        num_keys: key columns ``0 .. num_keys - 1`` to classify.
        sliding_window: ``W`` tokens; the first query reaches back furthest, to
            ``seq_len - query_len - W + 1``.
        key_offsets: ``[num_reqs]``, ``torch.int64``, same device: column ``j`` of request
            ``r`` is key position ``key_offsets[r] + j``; ``None`` means all zero.

    Returns:
        ``[num_reqs, num_keys]``, ``torch.bool``.
    """
    key_pos = torch.arange(num_keys, device=seq_lens.device).unsqueeze(0)
    if key_offsets is not None:
        key_pos = key_pos + key_offsets.unsqueeze(1)
    used = key_pos < seq_lens.unsqueeze(1)
    if sliding_window is not None:
        used &= key_pos > (seq_lens - query_len - sliding_window).unsqueeze(1)
    return used


def visibility_mask(query_positions: torch.Tensor, seq_lens: torch.Tensor, key_start: int,
                    key_end: int, causal: bool = True, sliding_window: int | None = None,
                    key_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query may attend to.

    Args:
        query_positions: ``[num_reqs, query_len]``, ``torch.int64``; the position of each
            query token within its request (``num_computed_tokens + j``).
        seq_lens: ``[num_reqs]``, ``torch.int64``, same device; keys ``0 .. seq_len - 1``
            exist for each request.
        key_start, key_end: the key positions ``key_start .. key_end - 1`` (end exclusive)
            that form the mask's columns.
        causal: bottom-right aligned causal mask (key ``k`` visible iff ``k <= p``);
            ``False`` lets every query see all of its request's keys.
        sliding_window: ``W`` tokens (current included): also require ``k > p - W``.
        key_offsets: ``[num_reqs]``, ``torch.int64``, same device: then ``key_start ..
            key_end - 1`` are key *columns*, column ``j`` of request ``r`` being key
            position ``key_offsets[r] + j`` (key ranges that start at a window).

    Returns:
        ``[num_reqs, query_len, key_end - key_start]``, ``torch.bool``; True = visible.
    """
    key_pos = torch.arange(key_start, key_end, device=query_positions.device).view(1, 1, -1)
    if key_offsets is not None:
        key_pos = key_pos + key_offsets.view(-1, 1, 1)
    q = query_positions.unsqueeze(-1)
    mask = key_pos < seq_lens.view(-1, 1, 1)
    if causal:
        mask = mask & (key_pos <= q)
    if sliding_window is not None:
        mask = mask & (key_pos > q - sliding_window)
    return mask


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
           scale: float, logits_soft_cap: float | None = None,
           sinks: torch.Tensor | None = None,
           alibi: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Masked multi-head attention with GQA/MQA, computed in float32.

    Args:
        query: ``[num_reqs, query_len, num_heads, head_size]``.
        key, value: ``[num_reqs, num_keys, num_kv_heads, head_size]`` (any strides, e.g. a
            slice of what :func:`gather_from_paged_cache` returns);
            ``num_heads % num_kv_heads == 0``; query head ``h`` uses KV head
            ``h // (num_heads // num_kv_heads)`` (HF ``repeat_kv`` order). Values of keys
            no query sees must be finite (keys may hold anything).
        mask: ``[num_reqs, query_len, num_keys]``, ``torch.bool``, True = visible. Every
            query row must see at least one key (a fully masked row gives NaN).
        scale: multiplies ``q . k`` (usually ``head_size ** -0.5``); applied to ``q``
            before the product.
        logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)`` after scaling
            and before masking (Gemma-2 convention).
        sinks: ``None`` or ``[num_heads]`` float32 sink logits: one more logit column per
            query head in the softmax, with no value (``backends/common/sinks.py``).
        alibi: ``None`` or ``(slopes, distance)``: ALiBi (Press et al., vLLM's
            ``alibi_slopes``): ``slopes`` ``[num_heads]`` float32, ``distance`` ``[num_reqs,
            query_len, num_keys]`` float32 = query position - key position; head ``h``'s
            logits get ``- slopes[h] * distance`` after scaling and the soft-cap, before
            masking (vLLM's order).

    Returns:
        ``[num_reqs, query_len, num_heads, head_size]``, float32.
    """
    n, q_len, num_heads, head_size = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    # [n, num_kv_heads, group * q_len, D]: the query heads of one KV head stacked along the rows.
    q = (query.float() * scale).view(n, q_len, num_kv_heads, group, head_size)
    q = q.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group * q_len, head_size)
    value = value.float()
    hidden_mask = ~mask.unsqueeze(1)  # [n, 1, q_len, keys], broadcast over the group
    out = torch.empty(n, q_len, num_kv_heads, group, head_size, dtype=torch.float32, device=query.device)
    for h in range(num_kv_heads):  # one KV head and its `group` query heads at a time
        # A contiguous [n, keys, D] copy: bmm against a strided K^T is several times slower.
        k = key[:, :, h].to(torch.float32, memory_format=torch.contiguous_format)
        logits = torch.bmm(q[:, h], k.transpose(1, 2))  # [n, group * q_len, keys]
        if logits_soft_cap is not None:
            logits = logits.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
        logits = logits.view(n, group, q_len, -1)
        if alibi is not None:
            slopes, distance = alibi
            logits = logits - slopes[h * group:(h + 1) * group].view(1, group, 1, 1) * distance.unsqueeze(1)
        logits = logits.masked_fill_(hidden_mask, float("-inf"))
        head_sinks = None if sinks is None else sinks[h * group:(h + 1) * group].view(1, group, 1, 1)
        probs = softmax_with_sinks(logits, head_sinks).view(n, group * q_len, -1)
        head_out = torch.bmm(probs, value[:, :, h])  # [n, group * q_len, D]
        out[:, :, h] = head_out.view(n, group, q_len, head_size).transpose(1, 2)
    return out.view(n, q_len, num_heads, head_size)
