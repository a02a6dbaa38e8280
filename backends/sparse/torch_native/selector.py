"""``TorchNativeSelectorImpl``: the selector contract (``core/sparse.py``) as dense torch math.

Per real query ``t``: gather the key rows of positions ``key_start[t] .. key_end[t] - 1`` of
its request (others masked AND zeroed, so nothing outside the range is ever read into a
score), ``score = sum_h w[t, h] * relu(scale * q[t, h] . k)`` in float32, then a stable
descending sort (ties: lower position first) keeps the first ``index_topk``.
"""

from __future__ import annotations

import torch

from attnplug.backends.sparse.common.ranges import write_rows
from attnplug.core.sparse import SelectorImpl, SelectorMetadata


def gather_key_rows(kv_cache: torch.Tensor, md: SelectorMetadata, num_tokens: int):
    """``(rows [T, S, D] float32, live [T, S] bool)``: each query's visible key rows, zero
    outside its range (``S = ranges.max_key_len``)."""
    r, bs = md.ranges, md.block_size
    cols = torch.arange(r.max_key_len, device=kv_cache.device)
    live = (cols.unsqueeze(0) >= r.key_start[:num_tokens].unsqueeze(1).long()) & \
        (cols.unsqueeze(0) < r.key_end[:num_tokens].unsqueeze(1).long())
    pos = torch.where(live, cols.unsqueeze(0), torch.zeros_like(cols).unsqueeze(0))
    blocks = md.block_table.long()[r.req_of_token[:num_tokens].unsqueeze(1), pos // bs]
    rows = kv_cache.view(-1, kv_cache.shape[2])[blocks * bs + pos % bs]
    rows = torch.where(live.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return rows.float(), live


def index_scores(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """``[T, S]`` float32: ``sum_h weights[t, h] * relu(scale * q[t, h] . rows[t, s])``."""
    s = torch.relu(torch.einsum("thd,tsd->ths", q.float(), rows) * scale)
    return torch.einsum("th,ths->ts", weights.float(), s)


def select_topk(scores: torch.Tensor, live: torch.Tensor, topk: int) -> torch.Tensor:
    """``[T, min(topk, S)]`` int64 positions by descending score, ties to the lower position,
    ``-1`` past the live keys."""
    s = scores.masked_fill(~live, float("-inf"))
    k = min(topk, s.shape[1])
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(live.gather(1, order), order, torch.full_like(order, -1))


class TorchNativeSelectorImpl(SelectorImpl):
    """Reference selector (see the module docstring)."""

    def forward(self, q, k, weights, kv_cache, attn_metadata, topk_indices):
        md = attn_metadata
        write_rows(k, kv_cache, md.slot_mapping)
        topk_indices.fill_(-1)
        t = md.num_actual_tokens
        if t == 0 or md.ranges.max_key_len == 0:
            return topk_indices
        rows, live = gather_key_rows(kv_cache, md, t)
        sel = select_topk(index_scores(q[:t], weights[:t], rows, self.scale), live, self.index_topk)
        topk_indices[:t, : sel.shape[1]] = sel.to(topk_indices.dtype)
        return topk_indices
