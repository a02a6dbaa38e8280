"""``FlashInferMetadata``: one step of one cache group, planned for FlashInfer.

Rows are in batch order with decodes (one query token) first and prefills last (the
builder's ``reorder_batch_threshold = 1`` makes the runner order them so). Page
metadata follows FlashInfer's CSR convention: request ``i`` owns pages
``paged_kv_indices[paged_kv_indptr[i] : paged_kv_indptr[i+1]]`` and has
``page_size * (num_pages_i - 1) + paged_kv_last_page_len[i]`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class FlashInferPlanKey:
    """What a plan depends on besides the step: one per distinct layer configuration."""

    num_qo_heads: int
    window_left: int
    """Inclusive left window (``W - 1``), ``-1`` = unbounded."""
    logits_soft_cap: float
    """0.0 = off."""
    sm_scale: float


@dataclass(frozen=True)
class FlashInferPlan:
    """The planned wrappers of one :class:`FlashInferPlanKey` (``None`` for an empty slice)."""

    decode: Any | None
    prefill: Any | None


@dataclass(frozen=True)
class FlashInferMetadata:
    """What every ``flashinfer`` layer of a cache group reads in one step.

    ``B`` is the batch the page metadata covers: ``num_reqs``, or the padded batch for a
    pure-decode step (padded requests own no pages).
    """

    num_reqs: int
    """Real (non-padded) requests."""
    num_actual_tokens: int
    """Real (non-padded) tokens."""
    num_decodes: int
    """Decode requests (rows ``0 .. num_decodes - 1``; one query token each)."""
    num_decode_tokens: int
    """Query rows the decode wrapper runs on: ``num_decodes``, or the padded batch of a
    pure-decode step (CUDA graphs)."""
    num_prefills: int
    """Prefill requests (rows ``num_decodes .. num_reqs - 1``)."""
    num_prefill_tokens: int
    """Their query tokens (rows ``num_decode_tokens .. num_actual_tokens - 1`` of the stream
    when there are prefills)."""
    page_size: int
    """Tokens per page (the kernel block size)."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` (padded length), ``torch.int64``, device; ``PAD_SLOT_ID`` = not written."""
    paged_kv_indptr: torch.Tensor
    """``[B + 1]``, ``torch.int32``, CPU: exclusive prefix sum of pages per request."""
    paged_kv_indices: torch.Tensor
    """``[paged_kv_indptr[B]]``, ``torch.int32``, device: every request's pages in order."""
    paged_kv_last_page_len: torch.Tensor
    """``[B]``, ``torch.int32``, CPU: keys in each request's last page, ``1 .. page_size``."""
    qo_indptr: torch.Tensor
    """``[num_prefills + 1]``, ``torch.int32``, CPU: query offsets within the prefill slice."""
    plans: dict[FlashInferPlanKey, FlashInferPlan] = field(default_factory=dict)
    """The planned wrappers, one entry per distinct layer configuration of the group."""
