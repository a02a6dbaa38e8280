"""The case's inputs (Q/K/V per request and position) and a dense float64 oracle.

Every token's query, key and value depend only on (case seed, request, position), so
two runs that batch or order requests differently (a backend that reorders decodes
first, say) still see identical inputs and can be compared token by token.

The dense oracle attends over the generated K/V directly (no paging): it is what the
suite holds ``torch_native`` itself to, so the reference is checked too.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from attnplug.plugins.conformance.cases import ConformanceCase
from attnplug.plugins.conformance.requirements import torch_dtype

SOFTCAP_QUERY_GAIN = 4.0
"""Queries of soft-capped cases are scaled by this so that logits exceed the cap."""


class CaseInputs:
    """Per request ``i`` with ``L_i = computed_i + scheduled_i`` tokens: ``query``
    ``[L_i, num_heads, head_size]``, ``key``/``value`` ``[L_i, num_kv_heads, head_size]`` in
    the case dtype, concatenated over requests (``offsets[i]`` is request i's first row)."""

    def __init__(self, case: ConformanceCase):
        self.case = case
        dtype = torch_dtype(case.dtype)
        lens = [c + s for c, s in case.requests]
        self.offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        qs, ks, vs = [], [], []
        for i, n in enumerate(lens):
            g = torch.Generator().manual_seed(case.seed * 7919 + i)
            q = torch.randn(n, case.num_heads, case.head_size, generator=g)
            if case.logits_soft_cap is not None:
                q = q * SOFTCAP_QUERY_GAIN
            qs.append(q)
            ks.append(torch.randn(n, case.num_kv_heads, case.head_size, generator=g))
            vs.append(torch.randn(n, case.num_kv_heads, case.head_size, generator=g))
        self.sinks: torch.Tensor | None = None
        """``[num_heads]`` float32 sink logits when ``case.sinks`` (spread around the logits'
        log-sum-exp so that the sink's share matters), else ``None``."""
        if case.sinks:
            g = torch.Generator().manual_seed(case.seed * 7919 + 104729)
            self.sinks = torch.randn(case.num_heads, generator=g) * 1.5 + 1.0
        self.query = torch.cat(qs).to(dtype)
        self.key = torch.cat(ks).to(dtype)
        self.value = torch.cat(vs).to(dtype)

    def rows(self, token_req: np.ndarray, token_pos: np.ndarray) -> torch.Tensor:
        """``[num_tokens]`` int64 rows of the tables for (request index, position) pairs."""
        return torch.as_tensor(self.offsets[token_req] + token_pos, dtype=torch.int64)


def dense_attention(inputs: CaseInputs, token_req: np.ndarray, token_pos: np.ndarray,
                    kv_head_of: Sequence[int] | None = None) -> torch.Tensor:
    """``[num_tokens, num_heads, head_size]`` float64: exact attention of each (request,
    position) query over keys ``0 .. position`` of its request (and inside the window).

    ``kv_head_of[h]`` is the KV head query head ``h`` reads; default ``h // (num_heads //
    num_kv_heads)``, the GQA convention (HF ``repeat_kv``). Another mapping serves the
    diagnosis of a failure (``diagnosis.py``).

    Loops over requests (test code, not a hot path).
    """
    case = inputs.case
    group = case.num_heads // case.num_kv_heads
    if kv_head_of is None:
        kv_head_of = [h // group for h in range(case.num_heads)]
    kv_index = torch.as_tensor(list(kv_head_of), dtype=torch.int64)
    out = torch.zeros(len(token_req), case.num_heads, case.head_size, dtype=torch.float64)
    for i in np.unique(token_req):
        sel = np.flatnonzero(token_req == i)
        pos = torch.as_tensor(token_pos[sel], dtype=torch.int64)
        base = int(inputs.offsets[i])
        n = int(pos.max()) + 1
        q = inputs.query[base + pos].double()                                  # [t, H, D]
        k = inputs.key[base:base + n].double()[:, kv_index]                    # [n, H, D]
        v = inputs.value[base:base + n].double()[:, kv_index]
        logits = torch.einsum("thd,nhd->htn", q, k) * case.softmax_scale
        if case.logits_soft_cap is not None:
            cap = case.logits_soft_cap
            logits = cap * torch.tanh(logits / cap)
        keys = torch.arange(n)
        visible = keys[None, :] <= pos[:, None]
        if case.sliding_window is not None:
            visible &= keys[None, :] > pos[:, None] - case.sliding_window
        logits = logits.masked_fill(~visible[None], float("-inf"))
        if inputs.sinks is not None:  # the sink column: in the denominator, with no value
            sink_col = inputs.sinks.double().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
            probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out[torch.as_tensor(sel)] = torch.einsum("htn,nhd->thd", probs, v)
    return out
