"""``SdpaAttentionImpl``: write K/V into the paged cache, then SDPA per request."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnplug import AttentionImpl
from attnplug_sdpa_example.metadata import SdpaMetadata


class SdpaAttentionImpl(AttentionImpl):
    """One layer's attention. Query j of a request with ``seq_len`` keys and ``L`` queries
    sits at position ``seq_len - L + j`` and sees keys ``k`` with ``k <= position`` and,
    with a window ``W``, ``k > position - W`` (causal, bottom-right aligned). The builder
    gathers keys from ``first_key`` on only: nothing before the window is read."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: SdpaMetadata, output):
        md = attn_metadata
        block_size = kv_cache.shape[2]
        # 1. Write this step's K/V at their slots (padded tokens were dropped by the builder).
        blocks, offsets = md.write_slots // block_size, md.write_slots % block_size
        kv_cache[blocks, 0, offsets] = key[md.write_token_indices].to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value[md.write_token_indices].to(kv_cache.dtype)
        # 2. Gather every request's keys and values from first_key on (flat, request after request).
        kb, ko = md.key_slots // block_size, md.key_slots % block_size
        keys, values = kv_cache[kb, 0, ko], kv_cache[kb, 1, ko]
        group = self.num_heads // self.num_kv_heads
        # 3. One SDPA call per request (a loop over requests, never over tokens).
        for i, seq_len in enumerate(md.seq_lens):
            q_lo, q_hi = md.query_start_loc[i], md.query_start_loc[i + 1]
            if q_hi == q_lo:
                continue
            k_lo, k_hi, first = md.key_start_loc[i], md.key_start_loc[i + 1], md.first_key[i]
            q = query[q_lo:q_hi].transpose(0, 1)                                     # [H, L, D]
            k = keys[k_lo:k_hi].repeat_interleave(group, dim=1).transpose(0, 1)      # [H, S, D]
            v = values[k_lo:k_hi].repeat_interleave(group, dim=1).transpose(0, 1)
            pos = torch.arange(seq_len - (q_hi - q_lo), seq_len, device=query.device)[:, None]
            key_pos = torch.arange(first, seq_len, device=query.device)[None, :]
            visible = key_pos <= pos
            if self.sliding_window is not None:
                visible &= key_pos > pos - self.sliding_window
            out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=visible,
                                                 scale=self.scale)
            output[q_lo:q_hi] = out.transpose(0, 1).to(output.dtype)
        return output
