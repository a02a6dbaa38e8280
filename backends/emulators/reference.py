"""The arithmetic both kernel emulators share: attention of one request's queries over an
explicit key list with explicit, per-query visible key ranges.

Each emulator derives the key list and the ranges from *its kernel's own arguments*
(FlashAttention: ``cu_seqlens_q``, ``seqused_k``/``cu_seqlens_k``, ``block_table``,
``window_size``; FlashInfer: ``qo_indptr``, ``indptr``, ``indices``,
``last_page_len``, ``window_left``), which is what the emulators check. This module only
does the math, in float32, the way the kernels define it: scale, optional soft-cap
``cap * tanh(x / cap)``, mask, softmax; a query that sees no key gets zeros and
``lse = -inf``.
"""

from __future__ import annotations

import torch


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Keys ``0 .. num_keys - 1`` of one request from an NHD paged cache.

    Args:
        cache: ``[num_pages, page_size, num_kv_heads, head_size]``.
        page_ids: ``[>= cdiv(num_keys, page_size)]`` int, the request's pages in order.
        num_keys: tokens to return.

    Returns:
        ``[num_keys, num_kv_heads, head_size]`` (a copy).
    """
    page_size = cache.shape[1]
    n = -(-num_keys // page_size)
    return cache.index_select(0, page_ids[:n].long()).flatten(0, 1)[:num_keys]


def attend_ranges(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over ``k``/``v`` where query ``j`` sees keys ``lo[j] ..= hi[j]``.

    Args:
        q: ``[num_queries, num_heads, head_size]``.
        k, v: ``[num_keys, num_kv_heads, head_size]``; query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``.
        lo, hi: ``[num_queries]`` int64, inclusive key bounds (empty when ``lo > hi``).
        scale: multiplies ``q . k``.
        softcap: ``None``/0 = off, else logits become ``cap * tanh(logits / cap)``.

    Returns:
        ``(out [num_queries, num_heads, head_size] float32, lse [num_heads, num_queries]
        float32)``, natural-log ``lse``.
    """
    nq, num_heads, _ = q.shape
    if nq and k.shape[0]:
        # Keys before the first visible one or after the last are never loaded: the kernels
        # skip whole key tiles outside every query's range (FlashAttention's n_block_min /
        # n_block_max, FlashInfer's window), so blocks freed by a sliding window, or the
        # null block in their place, are not read (docs/conformance.md: they hold NaN there).
        first, last = max(int(lo.min()), 0), min(int(hi.max()), k.shape[0] - 1)
        k, v = k[first:last + 1], v[first:last + 1]
        lo, hi = lo - first, hi - first
    nk, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kk = k.float().repeat_interleave(group, dim=1)  # [nk, H, D]
    vv = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    pos = torch.arange(nk, device=q.device).view(1, nk)
    visible = (pos >= lo.view(nq, 1)) & (pos <= hi.view(nq, 1))  # [nq, nk]
    logits = logits.masked_fill(~visible.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1) if nk else torch.full((num_heads, nq), float("-inf"), device=q.device)
    probs = torch.where(visible.unsqueeze(0), torch.exp(logits - lse.unsqueeze(-1).clamp_min(-1e30)),
                        torch.zeros((), device=q.device))
    out = torch.einsum("hqk,khd->qhd", probs, vv)
    return out, lse
