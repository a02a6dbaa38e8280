"""The Triton selector and consumer impls (kernels: ``backends/triton/sparse_kernels.py``)."""

from __future__ import annotations

import torch

from attnplug.backends.sparse.common.consumer import SparseMLACommonImpl
from attnplug.backends.sparse.common.ranges import write_rows
from attnplug.backends.sparse.torch_native.selector import select_topk
from attnplug.backends.sparse.triton.ops import indexer_scores, sparse_mla
from attnplug.core.sparse import SelectorImpl


class TritonSelectorImpl(SelectorImpl):
    """Writes the key rows (torch), scores with ``indexer_scores_kernel``, keeps the top-k
    with a stable descending sort (ties to the lower position)."""

    def forward(self, q, k, weights, kv_cache, attn_metadata, topk_indices):
        md = attn_metadata
        write_rows(k, kv_cache, md.slot_mapping)
        topk_indices.fill_(-1)
        t = md.num_actual_tokens
        if t == 0 or md.ranges.max_key_len == 0:
            return topk_indices
        scores = indexer_scores(q.to(kv_cache.dtype).contiguous(), weights.float(), kv_cache, md, t, self.scale)
        r = md.ranges
        cols = torch.arange(scores.shape[1], device=scores.device)
        live = (cols.unsqueeze(0) >= r.key_start[:t].unsqueeze(1).long()) & \
            (cols.unsqueeze(0) < r.key_end[:t].unsqueeze(1).long())
        sel = select_topk(scores, live, self.index_topk)
        topk_indices[:t, : sel.shape[1]] = sel.to(topk_indices.dtype)
        return topk_indices


class TritonSparseMLAImpl(SparseMLACommonImpl):
    """``forward_sparse`` = ``sparse_mla_kernel``."""

    def forward_sparse(self, q, kv_cache, slots):
        return sparse_mla(q.contiguous(), kv_cache, slots.contiguous(), kv_lora_rank=self.kv_lora_rank,
                          scale=self.scale)
