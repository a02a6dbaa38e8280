"""Planted bugs in copies of the torch_native selector and consumer (issue 34): each must
fail its sparse conformance family with a message naming the case.

Loaded by path (``conftest.py`` puts this folder on ``sys.path``) so ``attnplug check
buggy_sparse:BatchWideTopK`` works from the tests.
"""

from __future__ import annotations

import dataclasses

import torch

from attnplug.backends.sparse.torch_native.backend import TorchNativeIndexerBackend, TorchNativeSparseMLABackend
from attnplug.backends.sparse.torch_native.consumer import TorchNativeSparseMLAImpl
from attnplug.backends.sparse.torch_native.selector import TorchNativeSelectorImpl, index_scores, select_topk


class _BatchWideImpl(TorchNativeSelectorImpl):
    """Takes the top-k over every key row of the whole step's batch (all requests' blocks,
    concatenated), not over the query's own request, and returns the positions within
    whichever request each winner belongs to."""

    def forward(self, q, k, weights, kv_cache, attn_metadata, topk_indices):
        md = attn_metadata
        topk_indices.fill_(-1)
        from attnplug.backends.sparse.common.ranges import write_rows
        write_rows(k, kv_cache, md.slot_mapping)
        t = md.num_actual_tokens
        bs = md.block_size
        flat = kv_cache.view(-1, kv_cache.shape[2])
        rows, pos_of = [], []
        for r in range(md.num_reqs):
            n = int(md.seq_lens[r])
            p = torch.arange(n)
            rows.append(flat[md.block_table[r, p // bs].long() * bs + p % bs])
            pos_of.append(p)
        rows, pos_of = torch.cat(rows).float(), torch.cat(pos_of)
        s = index_scores(q[:t], weights[:t], rows.unsqueeze(0).expand(t, -1, -1), self.scale)
        live = pos_of.unsqueeze(0) < md.ranges.key_end[:t].unsqueeze(1).long()     # "causal" by position only
        sel = select_topk(s, live, self.index_topk)
        sel = torch.where(sel >= 0, pos_of[sel.clamp(min=0)], sel)
        topk_indices[:t, : sel.shape[1]] = sel.to(topk_indices.dtype)
        return topk_indices


class _FutureImpl(TorchNativeSelectorImpl):
    """Lets every query see its whole request (the step's later tokens too): key_end = seq_len."""

    def forward(self, q, k, weights, kv_cache, attn_metadata, topk_indices):
        md = attn_metadata
        end = md.seq_lens.to(torch.int32)[md.ranges.req_of_token]
        end = torch.where(md.ranges.key_end > 0, end, md.ranges.key_end)
        ranges = dataclasses.replace(md.ranges, key_end=end)
        return super().forward(q, k, weights, kv_cache, dataclasses.replace(md, ranges=ranges), topk_indices)


class _LaterWinsTiesImpl(TorchNativeSelectorImpl):
    """Breaks ties toward the later position (sorts the reversed row)."""

    def forward(self, q, k, weights, kv_cache, attn_metadata, topk_indices):
        import attnplug.backends.sparse.torch_native.selector as sel_mod

        def later_wins(scores, live, topk):
            flipped = scores.masked_fill(~live, float("-inf")).flip(-1)
            order = flipped.shape[1] - 1 - torch.sort(flipped, dim=-1, descending=True, stable=True).indices
            order = order[:, : min(topk, flipped.shape[1])]
            return torch.where(live.gather(1, order), order, torch.full_like(order, -1))

        saved, sel_mod.select_topk = sel_mod.select_topk, later_wins
        try:
            return super().forward(q, k, weights, kv_cache, attn_metadata, topk_indices)
        finally:
            sel_mod.select_topk = saved


class _MinusOneAsZeroImpl(TorchNativeSparseMLAImpl):
    """Maps an index of -1 to slot row of position 0 (clamps instead of masking)."""

    def forward(self, layer, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output, topk_indices=None):
        return super().forward(layer, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output,
                               topk_indices=topk_indices.clamp(min=0))


def _with_impl(base, name, impl):
    return type(name, (base,), {"get_impl_cls": classmethod(lambda cls: impl),
                                "get_name": classmethod(lambda cls: name)})


BatchWideTopK = _with_impl(TorchNativeIndexerBackend, "BatchWideTopK", _BatchWideImpl)
SelectsFuture = _with_impl(TorchNativeIndexerBackend, "SelectsFuture", _FutureImpl)
LaterWinsTies = _with_impl(TorchNativeIndexerBackend, "LaterWinsTies", _LaterWinsTiesImpl)
MinusOneAsZero = _with_impl(TorchNativeSparseMLABackend, "MinusOneAsZero", _MinusOneAsZeroImpl)
