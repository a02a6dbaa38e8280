"""``TorchNativeMLAImpl``: the two MLA kernels as dense torch math (float32 softmax).

* ``forward_mqa``: gather each decode's latent rows ``0 .. seq_len - 1`` from its blocks
  (positions past ``seq_len`` are masked AND zeroed, so whatever the null block holds is
  never read into a result), scores ``q . row``, softmax, weighted sum of ``row[:L]``.
* ``forward_mha``: one ``[total_q, total_k]`` mask per call (same request; causal
  bottom-right when asked), no host synchronisation.
"""

from __future__ import annotations

import torch

from attnplug.backends.mla.common.impl import MLACommonImpl
from attnplug.core.mla import MLADecodeMetadata


def _softmax_lse(scores: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax over the last dim (float32) and its natural-log LSE; all-masked
    rows give zero probabilities and ``-inf``."""
    s = scores.float().masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return p.masked_fill(~mask, 0.0), lse


def _segment_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]``: the segment of each flat row of a ``cu`` (exclusive prefix sum)."""
    rows = torch.arange(total, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), rows, right=True)


class TorchNativeMLAImpl(MLACommonImpl):
    """Reference MLA impl (see the module docstring)."""

    def forward_mqa(self, q: torch.Tensor, kv_cache: torch.Tensor,
                    decode: MLADecodeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        b = decode.num_decodes
        bs = kv_cache.shape[1]
        cols = torch.arange(decode.max_seq_len, device=q.device)
        live = cols.unsqueeze(0) < decode.seq_lens[:b].unsqueeze(1).long()            # [B, S]
        pos = torch.where(live, cols.unsqueeze(0), torch.zeros_like(cols).unsqueeze(0))
        blocks = decode.block_table[:b].long().gather(1, pos // bs)
        rows = kv_cache.view(-1, kv_cache.shape[2])[blocks * bs + pos % bs]           # [B, S, L+R]
        rows = torch.where(live.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device)).float()
        scores = torch.einsum("bnd,bsd->bns", q.float(), rows) * self.scale
        p, lse = _softmax_lse(scores, live.unsqueeze(1))
        o = torch.einsum("bns,bsl->bnl", p, rows[..., : self.kv_lora_rank])
        return o.to(q.dtype), lse.transpose(0, 1).contiguous()

    def forward_mha(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        tq, tk = q.shape[0], k.shape[0]
        seg_q, seg_k = _segment_ids(cu_seqlens_q, tq), _segment_ids(cu_seqlens_k, tk)
        mask = seg_q.unsqueeze(1) == seg_k.unsqueeze(0)                              # [Tq, Tk]
        if causal:
            cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()
            j = torch.arange(tq, device=q.device) - cq[seg_q]                        # query index in request
            kk = torch.arange(tk, device=q.device) - ck[seg_k]                       # key index in request
            shift = (ck[1:] - ck[:-1]) - (cq[1:] - cq[:-1])                          # n_k - n_q per request
            mask &= kk.unsqueeze(0) <= (j + shift[seg_q]).unsqueeze(1)
        scores = torch.einsum("qnd,knd->nqk", q.float(), k.float()) * self.scale
        p, lse = _softmax_lse(scores, mask.unsqueeze(0))
        out = torch.einsum("nqk,knv->qnv", p, v.float())
        return out.to(q.dtype), lse
