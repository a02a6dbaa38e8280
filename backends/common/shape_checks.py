"""The per-head shapes of one layer's ``query`` / ``key`` / ``value``, checked the same way by
every paged attention impl (``torch_native``, ``triton``, ``flash_attn``, ``flashinfer``)
before anything is written."""

from __future__ import annotations

import torch


def qkv_shape_problems(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_heads: int,
                       num_kv_heads: int, head_size: int) -> list[str]:
    """Reasons the tensors do not have their contract shapes (empty: fine).

    ``query``: ``[num_tokens, num_heads, head_size]``; ``key`` and ``value``:
    ``[num_tokens, num_kv_heads, head_size]`` (row counts are the caller's to check against
    its metadata). One reason per tensor, in the order query, key, value.
    """
    problems = []
    expect_q, expect_kv = (num_heads, head_size), (num_kv_heads, head_size)
    if query.dim() != 3 or tuple(query.shape[1:]) != expect_q:
        problems.append(f"query {tuple(query.shape)} should be [num_tokens, {expect_q[0]}, {expect_q[1]}]")
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != expect_kv:
            problems.append(f"{name} {tuple(t.shape)} should be [num_tokens, {expect_kv[0]}, {expect_kv[1]}]")
    return problems
