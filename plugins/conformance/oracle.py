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

FP8_AMAX = 5.0
"""The |K| / |V| (before the per-head gains) an fp8 case's scales are sized for: a standard
normal exceeds it with probability 6e-7 (and saturates alike in backend and golden)."""


def fp8_head_gains(case: ConformanceCase) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_gain, v_gain)``, float32 ``[num_kv_heads]``: an fp8 case's K of head ``h`` is
    scaled by ``1 + 2h`` and V by ``1 / (1 + h)``, so every head needs its own scale."""
    h = torch.arange(case.num_kv_heads, dtype=torch.float32)
    return 1.0 + 2.0 * h, 1.0 / (1.0 + h)


def case_kv_scales(case: ConformanceCase) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``k_scale`` / ``v_scale`` (float32, ``[num_kv_heads]`` or ``[]``) an fp8 case
    gives the impl: ``gain_h * FP8_AMAX / finfo.max`` (the largest gain for per-tensor
    scales); ``(None, None)`` for an ``auto`` case."""
    if case.kv_cache_dtype == "auto":
        return None, None
    from attnplug.core.kv_quant import parse_kv_cache_dtype

    big = torch.finfo(parse_kv_cache_dtype(case.kv_cache_dtype)).max
    scales = tuple(g * FP8_AMAX / big for g in fp8_head_gains(case))
    if case.kv_scales == "per_tensor":
        scales = tuple(s.max() for s in scales)
    return scales


def alibi_slopes(case: ConformanceCase) -> torch.Tensor | None:
    """``[num_heads]`` float32 ALiBi slopes of an ``alibi`` case (Press et al.'s geometric
    sequence ``2 ** (-8 (h + 1) / num_heads)``), else ``None``."""
    if not case.alibi:
        return None
    return 2.0 ** (-8.0 * torch.arange(1, case.num_heads + 1, dtype=torch.float32) / case.num_heads)


def quantizes_query(backend_cls, case: ConformanceCase) -> bool:
    """``backend_cls`` reads this fp8 case's query in fp8 too (``supports_quant_query_input``,
    FA3): it is then held to the dense oracle over the dequantised query as well, at the
    bfloat16 tolerance (FA3's fp8 output is bfloat16), not to torch_native."""
    return case.kv_cache_dtype != "auto" and bool(getattr(backend_cls, "supports_quant_query_input", False))


def case_q_scale(case: ConformanceCase) -> torch.Tensor | None:
    """The float32 ``[]`` ``q_scale`` an fp8 case gives the impl (read only by backends that
    quantize the query): the query's expected amax over ``finfo.max``, non-unit so that a
    backend ignoring it (no ``q_descale``) fails; ``None`` for an ``auto`` case."""
    if case.kv_cache_dtype == "auto":
        return None
    from attnplug.core.kv_quant import parse_kv_cache_dtype

    gain = SOFTCAP_QUERY_GAIN if case.logits_soft_cap is not None else 1.0
    return torch.tensor(gain * FP8_AMAX / torch.finfo(parse_kv_cache_dtype(case.kv_cache_dtype)).max)


class CaseInputs:
    """Per request ``i`` with ``L_i = computed_i + scheduled_i`` tokens: ``query``
    ``[L_i, num_heads, head_size]``, ``key``/``value`` ``[L_i, num_kv_heads, head_size]`` in
    the case dtype, concatenated over requests (``offsets[i]`` is request i's first row)."""

    def __init__(self, case: ConformanceCase, quantized_query: bool = False):
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
        self.ref_key, self.ref_value = self.key, self.value
        """What the golden attends over: K/V themselves, or for an fp8 case their
        round trip through the cache (``saturate(x / scale)`` in fp8, times ``scale``)."""
        if case.kv_cache_dtype != "auto":
            from attnplug.core.kv_quant import dequantize_kv, parse_kv_cache_dtype, quantize_kv

            k_gain, v_gain = fp8_head_gains(case)
            self.key = (self.key.float() * k_gain.view(-1, 1)).to(dtype)
            self.value = (self.value.float() * v_gain.view(-1, 1)).to(dtype)
            cache = parse_kv_cache_dtype(case.kv_cache_dtype)
            k_scale, v_scale = case_kv_scales(case)
            self.ref_key = dequantize_kv(quantize_kv(self.key, k_scale, cache), k_scale, torch.float32)
            self.ref_value = dequantize_kv(quantize_kv(self.value, v_scale, cache), v_scale, torch.float32)
        self.ref_query = self.query
        """What the golden's queries are: the query, or with ``quantized_query`` (a backend that
        reads fp8 queries, :func:`quantizes_query`) its round trip through ``case_q_scale``."""
        if quantized_query and case.kv_cache_dtype != "auto":
            from attnplug.core.kv_quant import dequantize_kv, parse_kv_cache_dtype, quantize_kv

            q_scale = case_q_scale(case)
            stored = quantize_kv(self.query, q_scale, parse_kv_cache_dtype(case.kv_cache_dtype))
            self.ref_query = dequantize_kv(stored, q_scale, torch.float32)

    def rows(self, token_req: np.ndarray, token_pos: np.ndarray) -> torch.Tensor:
        """``[num_tokens]`` int64 rows of the tables for (request index, position) pairs."""
        return torch.as_tensor(self.offsets[token_req] + token_pos, dtype=torch.int64)


def dense_attention(inputs: CaseInputs, token_req: np.ndarray, token_pos: np.ndarray,
                    kv_head_of: Sequence[int] | None = None) -> torch.Tensor:
    """``[num_tokens, num_heads, head_size]`` float64: exact attention of each (request,
    position) query over keys ``0 .. position`` of its request (and inside the window);
    an fp8 case's keys and values are the dequantised ones (``CaseInputs.ref_key``).

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
        q = inputs.ref_query[base + pos].double()                              # [t, H, D]
        k = inputs.ref_key[base:base + n].double()[:, kv_index]                # [n, H, D]
        v = inputs.ref_value[base:base + n].double()[:, kv_index]
        logits = torch.einsum("thd,nhd->htn", q, k) * case.softmax_scale
        if case.logits_soft_cap is not None:
            cap = case.logits_soft_cap
            logits = cap * torch.tanh(logits / cap)
        keys = torch.arange(n)
        visible = keys[None, :] <= pos[:, None]
        if case.sliding_window is not None:
            visible &= keys[None, :] > pos[:, None] - case.sliding_window
        if case.alibi:  # - slope_h * (query position - key position)
            distance = (pos[:, None] - keys[None, :]).double()
            logits = logits - alibi_slopes(case).double().view(-1, 1, 1) * distance[None]
        logits = logits.masked_fill(~visible[None], float("-inf"))
        if inputs.sinks is not None:  # the sink column: in the denominator, with no value
            sink_col = inputs.sinks.double().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
            probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out[torch.as_tensor(sel)] = torch.einsum("htn,nhd->thd", probs, v)
    return out
