"""A FlashAttention yardstick for ``attnplug bench attention`` when flash-attn is not installed.

PyTorch's CUDA builds carry FlashAttention-2's forward kernel as the operator
``aten::_flash_attention_forward`` (the kernel behind ``scaled_dot_product_attention``'s
flash backend and ``torch.nn.attention.varlen``). Its variable-length form, stable since
torch 2.2, is::

    _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, return_debug_mask, *, scale=None, ...)
        -> (output, softmax_lse, rng_state, unused, debug_attn_mask)

with packed ``query`` ``[total_q, num_heads, head_size]``, ``key``/``value``
``[total_k, num_kv_heads, head_size]`` (GQA when ``num_heads % num_kv_heads == 0``),
``cum_seq_q``/``cum_seq_k`` int32 ``[num_reqs + 1]`` prefix sums, fp16/bf16 only, and a causal
mask aligned to the bottom-right corner (FlashAttention >= 2.1's convention, the one attnplug
uses: query ``j`` of a request with context ``c`` sees keys ``0 .. c + j``).

The yardstick runs that kernel on each request's whole K/V laid out **contiguously** (no
block table) and without the K/V-cache write that an attnplug ``forward`` includes: it times
the FlashAttention kernel on the same attention problem, the bar a paged backend is held to
when the flash-attn package cannot be installed (the project's device machine is offline).
It is a measurement aid for the bench only, never a backend: nothing registers it.
"""

from __future__ import annotations

from typing import Callable

import torch

NAME = "flash2 (torch, contiguous)"
"""The yardstick's row name in the bench table."""

NOTE = "PyTorch's bundled FlashAttention-2 on contiguous K/V; no K/V write; not a backend"


def contiguous_kv(requests: list[tuple[int, int]], kv_dense: tuple[torch.Tensor, torch.Tensor],
                  k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V every backend attends to, packed request after request.

    Args:
        requests: per request ``(num_computed_tokens, num_scheduled_tokens)``, in batch order.
        kv_dense: the bench's logical cache, K and V ``[sum(c + s), num_kv_heads, head_size]``
            each, request after request (``attention_inputs.dense_kv``).
        k_new, v_new: the step's new K/V ``[sum(s), num_kv_heads, head_size]``; a backend's
            ``forward`` writes them at positions ``c .. c + s - 1`` of each request, over the
            dense values, so the yardstick uses them there too.

    Returns:
        ``(key, value)``, fresh tensors shaped like ``kv_dense``'s.
    """
    device = k_new.device
    ctx = torch.tensor([c for c, _ in requests], dtype=torch.int64, device=device)
    new = torch.tensor([s for _, s in requests], dtype=torch.int64, device=device)
    starts = torch.cumsum(ctx + new, 0) - (ctx + new)  # each request's first row in kv_dense
    req = torch.repeat_interleave(torch.arange(len(requests), device=device), new)
    offset = torch.arange(int(new.sum()), device=device) - (torch.cumsum(new, 0) - new)[req]
    rows = starts[req] + ctx[req] + offset
    key, value = kv_dense[0].clone(), kv_dense[1].clone()
    key[rows] = k_new
    value[rows] = v_new
    return key, value


def _operator() -> Callable:
    """``torch.ops.aten._flash_attention_forward`` (a seam for the CPU tests)."""
    return torch.ops.aten._flash_attention_forward


def flash_reference(requests: list[tuple[int, int]], q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scale: float) -> Callable[[], torch.Tensor]:
    """A zero-argument call running the FlashAttention-2 varlen kernel; it returns the output,
    ``q``-shaped (a fresh tensor per call, as the operator allocates it).

    Args:
        requests: per request ``(num_computed_tokens, num_scheduled_tokens)``.
        q: ``[sum(s), num_heads, head_size]``; ``key``/``value`` from :func:`contiguous_kv`.
        scale: the softmax scale (``head_size ** -0.5`` in the bench).

    Raises:
        RuntimeError: from the operator when this torch build or device lacks it (CPU builds,
            float32, head sizes over 256, pre-Ampere GPUs); the bench reports the reason.
    """
    device = q.device
    q_lens = torch.tensor([s for _, s in requests], dtype=torch.int32, device=device)
    k_lens = torch.tensor([c + s for c, s in requests], dtype=torch.int32, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    cum_q = torch.cat([zero, torch.cumsum(q_lens, 0, dtype=torch.int32)])
    cum_k = torch.cat([zero, torch.cumsum(k_lens, 0, dtype=torch.int32)])
    max_q = max(s for _, s in requests)
    max_k = max(c + s for c, s in requests)
    op = _operator()

    def call() -> torch.Tensor:
        return op(q, key, value, cum_q, cum_k, max_q, max_k, 0.0, True, False, scale=scale)[0]

    return call


__all__ = ["NAME", "NOTE", "contiguous_kv", "flash_reference"]
