"""``TorchNativeSparseMLAImpl``: the consumer kernel as dense torch math (float32 softmax).

Gathers each query's selected latent rows (``-1`` slots are masked AND replaced by zeros, so
no byte outside the selection enters a result), scores ``q . row``, softmax, weighted sum of
``row[:kv_lora_rank]``.
"""

from __future__ import annotations

import torch

from attnplug.backends.sparse.common.consumer import SparseMLACommonImpl


class TorchNativeSparseMLAImpl(SparseMLACommonImpl):
    """Reference consumer (see the module docstring)."""

    def forward_sparse(self, q, kv_cache, slots):
        valid = slots >= 0                                                             # [T, K]
        flat = kv_cache.view(-1, kv_cache.shape[2])
        rows = flat[torch.where(valid, slots, torch.zeros_like(slots))]                  # [T, K, L+R]
        rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device)).float()
        scores = torch.einsum("tnd,tkd->tnk", q.float(), rows) * self.scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)                                          # [T, N]
        p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
        p = p.masked_fill(~valid.unsqueeze(1), 0.0)
        o = torch.einsum("tnk,tkl->tnl", p, rows[..., : self.kv_lora_rank])
        return o.to(q.dtype), lse.transpose(0, 1).contiguous()
