"""``TritonMLAImpl``: ``forward_mqa`` = the Triton MLA decode kernel; ``forward_mha`` =
``backends/triton``'s varlen paged kernel over the up-projected keys and values.

The prefill's K/V are plain ``[total_k, N, D]`` tensors, not a paged cache; they are
handed to the paged kernel as a cache of one-token blocks (``block_size = 1``, request
``r``'s key ``j`` in block ``cu_seqlens_k[r] + j``), so the same kernel serves it without a
copy. ``v`` is zero-padded from ``v_head_dim`` to the q/k head size, and the padding
sliced off the output.
"""

from __future__ import annotations

import torch

from attnplug.backends.mla.common.impl import MLACommonImpl
from attnplug.backends.mla.triton.decode import mla_decode
from attnplug.backends.triton.attention import paged_attention


class TritonMLAImpl(MLACommonImpl):
    """Triton MLA impl (see the module docstring)."""

    def forward_mqa(self, q, kv_cache, decode):
        b = decode.num_decodes
        return mla_decode(q[:b].contiguous(), kv_cache, decode.block_table, decode.seq_lens,
                          kv_lora_rank=self.kv_lora_rank, scale=self.scale,
                          num_kv_splits=getattr(decode, "num_kv_splits", 1))

    def forward_mha(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        tq, n, d = q.shape
        tk = k.shape[0]
        batch = cu_seqlens_q.shape[0] - 1
        lse = torch.full((tq, n), float("-inf"), dtype=torch.float32, device=q.device)
        out = torch.zeros(tq, n, d, dtype=q.dtype, device=q.device)
        if tk == 0 or tq == 0:
            return out[..., : v.shape[-1]], lse.transpose(0, 1)
        v_pad = v if v.shape[-1] == d else torch.nn.functional.pad(v, (0, d - v.shape[-1]))
        cols = torch.arange(max(max_seqlen_k, 1), device=q.device, dtype=torch.int32)
        table = (cu_seqlens_k[:-1].unsqueeze(1) + cols.unsqueeze(0)).clamp_(max=tk - 1).to(torch.int32)
        seq_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        paged_attention(q.contiguous(), k.contiguous().view(tk, 1, n, d), v_pad.contiguous().view(tk, 1, n, d), out,
                        cu_seqlens_q.to(torch.int32), seq_lens, table.contiguous(), num_reqs=batch,
                        max_query_len=max_seqlen_q, scale=self.scale, causal=causal, check_values=False, lse=lse)
        return out[..., : v.shape[-1]], lse.transpose(0, 1)
