"""The encoder cache: each image's encoder output computed once, kept while a request needs it.

vLLM keeps encoder outputs per multimodal item (keyed by content hash) between the step that
encodes an image and the steps whose chunks consume its placeholder rows; this is the same
idea, run by the model runner:

* :meth:`EncoderCache.rows` returns an image's ``[num_embeds, hidden_size]`` output: from the
  cache (a hit: the same hash, whichever request computed it) or computed now by the model's
  ``embed_image``; the asking request takes a reference on it.
* **Freeing policy.** A request drops its reference when its prefill passes the image's span
  (the step whose chunk reaches the span's last token: ``MMSlice.completes``), when it
  finishes (``finished_req_ids``), and when it is resumed after a preemption (its recompute
  asks again: a hit if another request still holds the image, else a recompute). An entry
  nobody references is freed at once. A preempted request keeps its references until it
  is resumed or finishes (the runner is not told of a preemption until then).
* **Budget** (``budget_tokens``, rows of all entries together): an image that does not fit
  beside the referenced entries is computed for the step and not kept (``num_uncached``);
  its next chunk computes it again. The scheduler is not asked to cut chunks to the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class EncoderCacheStats:
    """Counters: images encoded, hits, entries freed, images computed but not kept (over
    the budget), and the most rows held at once."""

    computed: int = 0
    hits: int = 0
    freed: int = 0
    uncached: int = 0
    peak_tokens: int = 0


class EncoderCache:
    """Encoder outputs keyed by ``mm_hash``, referenced by request ids.

    Args:
        budget_tokens: rows (placeholder tokens) the cache may hold in all; ``>= 1``.

    Attributes:
        entries: ``{mm_hash: [num_embeds, hidden_size] tensor}``.
        refs: ``{mm_hash: set of req_ids}`` (every entry has at least one).
        stats: :class:`EncoderCacheStats`.
    """

    def __init__(self, budget_tokens: int):
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise ValueError(f"encoder cache budget must be an int >= 1 (tokens), got {budget_tokens!r}")
        self.budget_tokens = budget_tokens
        self.entries: dict[str, torch.Tensor] = {}
        self.refs: dict[str, set[str]] = {}
        self.num_tokens = 0
        self.stats = EncoderCacheStats()

    def rows(self, req_id: str, mm_hash: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The encoder output of image ``mm_hash`` for ``req_id`` (a reference is taken when
        the output is kept); ``compute()`` runs on a miss."""
        out = self.entries.get(mm_hash)
        if out is not None:
            self.stats.hits += 1
            self.refs[mm_hash].add(req_id)
            return out
        out = compute()
        self.stats.computed += 1
        n = out.shape[0]
        if self.num_tokens + n > self.budget_tokens:
            self.stats.uncached += 1
            return out
        self.entries[mm_hash], self.refs[mm_hash] = out, {req_id}
        self.num_tokens += n
        self.stats.peak_tokens = max(self.stats.peak_tokens, self.num_tokens)
        return out

    def release(self, req_id: str, mm_hash: str) -> None:
        """``req_id`` needs image ``mm_hash`` no more; the entry goes when nobody does."""
        holders = self.refs.get(mm_hash)
        if holders is None:
            return
        holders.discard(req_id)
        if not holders:
            self.num_tokens -= self.entries.pop(mm_hash).shape[0]
            del self.refs[mm_hash]
            self.stats.freed += 1

    def release_request(self, req_id: str) -> None:
        """Drop every reference of ``req_id`` (finished, or resumed after a preemption)."""
        for h in [h for h, holders in self.refs.items() if req_id in holders]:
            self.release(req_id, h)
