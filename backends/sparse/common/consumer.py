"""``SparseMLACommonImpl``: one sparse MLA layer step, written once over a backend's kernel.

``forward`` (``N`` heads, ``L = kv_lora_rank``, ``R = qk_rope_head_dim``, ``P =
qk_nope_head_dim``, ``V = v_head_dim``, ``K = index_topk``):

1. write ``[kv_c_normed | k_pe]`` of every token at its slot (``concat_and_cache_mla``);
2. absorb ``W_UK``: ``q_lat = [q_nope @ W_UK | q_pe]`` ``[T, N, L + R]`` (prefill and decode
   alike: only ``K`` rows per query are read, so nothing is up-projected);
3. map the selector's positions to latent-cache rows through the MLA group's block table
   (``positions_to_slots``; ``-1`` stays ``-1``);
4. ``o_lat, lse = forward_sparse(q_lat, kv_cache, slots)``; ``out = o_lat @ W_UV^T`` ``[T, N, V]``.
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.backends.mla.common.cache import concat_and_cache_mla
from attnplug.backends.sparse.common.ranges import positions_to_slots
from attnplug.core.errors import MetadataError
from attnplug.core.mla import MLALayerConfig
from attnplug.core.sparse import SparseMLAImpl, SparseMLAMetadata


class SparseMLACommonImpl(SparseMLAImpl):
    """The shared ``forward``; subclasses implement ``forward_sparse``.

    Raises (constructor):
        MetadataError: inconsistent dimensions (each problem named).
    """

    def __init__(self, layer_config: MLALayerConfig, scale: float):
        problems = layer_config.problems()
        if problems:
            raise MetadataError("sparse MLA layer: " + "; ".join(problems))
        super().__init__(layer_config, scale)

    def forward(self, layer: Any, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: SparseMLAMetadata, output: torch.Tensor,
                topk_indices: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        if topk_indices is None:
            raise MetadataError("sparse MLA needs the selector's topk_indices [num_tokens, index_topk]")
        n, p, v, lr = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        w = layer.kv_b_proj.weight
        if tuple(w.shape) != (n * (p + v), lr):
            raise MetadataError(f"kv_b_proj.weight {tuple(w.shape)} must be [num_heads * (qk_nope_head_dim + "
                                f"v_head_dim), kv_lora_rank] = [{n * (p + v)}, {lr}]")
        concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, md.slot_mapping)
        t = md.num_actual_tokens
        if t == 0:
            return output
        w_kv = w.view(n, p + v, lr)
        w_uk, w_uv = w_kv[:, :p], w_kv[:, p:]
        ql_nope = torch.einsum("tnp,npl->tnl", q[:t, :, :p], w_uk.to(q.dtype))
        q_lat = torch.cat([ql_nope, q[:t, :, p:]], dim=-1).to(kv_cache.dtype)
        slots = positions_to_slots(topk_indices[:t], md.ranges.req_of_token, md.block_table, md.block_size)
        o_lat, _ = self.forward_sparse(q_lat, kv_cache, slots)
        output[:t] = torch.einsum("tnl,nvl->tnv", o_lat.to(q.dtype), w_uv.to(q.dtype))
        return output
