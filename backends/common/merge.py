"""Merging two partial attention results over disjoint key sets by their log-sum-exp.

Cascade attention splits each query's keys into a shared prefix and the request's own
suffix, attends to each separately, and combines: with ``o_a, lse_a`` the result over key
set A (``lse`` = natural log of the softmax denominator of the scaled, capped logits)
and ``o_b, lse_b`` over B, attention over ``A ∪ B`` is
``(exp(lse_a) * o_a + exp(lse_b) * o_b) / (exp(lse_a) + exp(lse_b))``.
"""

from __future__ import annotations

import torch


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> torch.Tensor:
    """Combine two partial attention outputs (computed in float32).

    Args:
        out_a: ``[num_tokens, num_heads, head_size]``, any float dtype; result over keys A.
        lse_a: ``[num_heads, num_tokens]``, float32; natural-log sum-exp of A's logits
            (FlashAttention's ``softmax_lse`` layout). A query that saw no key of A has
            ``-inf``, or ``+inf`` as FlashAttention's non-split kernels write it
            (``softmax.h``: ``Split ? -INFINITY : INFINITY`` for an empty row): both mean empty.
        out_b, lse_b: the same for key set B (disjoint from A).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``out_a.dtype``: attention over ``A ∪ B``.
        A query that saw no key in either set gets zeros.

    Numerically stable (shifts by the larger lse); no host synchronisation; graph-safe.

    Examples:
        >>> import torch
        >>> o = torch.ones(2, 1, 4); lse = torch.zeros(1, 2)
        >>> merge_attn_states(o, lse, 3 * o, lse)[0, 0].tolist()   # equal weights
        [2.0, 2.0, 2.0, 2.0]
    """
    la, lb = (lse.float().masked_fill(lse == float("inf"), float("-inf")).transpose(0, 1).unsqueeze(-1)  # [T, H, 1]
              for lse in (lse_a, lse_b))  # (no host tensor: nothing is copied to the device)
    top = torch.maximum(la, lb)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(la - top), torch.exp(lb - top)
    denom = wa + wb
    zero = torch.zeros((), dtype=torch.float32, device=out_a.device)
    part_a = torch.where(wa > 0, wa * out_a.float(), zero)  # an empty side may hold anything
    part_b = torch.where(wb > 0, wb * out_b.float(), zero)
    merged = (part_a + part_b) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return merged.to(out_a.dtype)
