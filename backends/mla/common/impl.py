"""``MLACommonImpl``: one MLA layer step, written once over a backend's two kernels.

``forward`` (shapes: ``core/mla.py``, ``N`` heads, ``L = kv_lora_rank``, ``R =
qk_rope_head_dim``, ``P = qk_nope_head_dim``, ``V = v_head_dim``):

1. write ``[kv_c_normed | k_pe]`` of every token at its slot (:meth:`write_cache`);
2. decodes (the first ``num_decode_tokens`` rows): ``ql_nope = q_nope @ W_UK``
   ``[B, N, L]``, ``o_lat, lse = forward_mqa([ql_nope | q_pe], cache)``, ``out = o_lat @
   W_UV^T`` ``[B, N, V]``;
3. prefills: up-project the new tokens' latents to ``k = [k_nope | k_pe]`` ``[T, N, P+R]``
   and ``v`` ``[T, N, V]``, ``forward_mha`` causal over them; then for each context chunk
   gather its latent rows into the workspace, up-project them, ``forward_mha`` without a
   mask, and merge into the running result by log-sum-exp.

``W_UK`` / ``W_UV`` are views of ``layer.kv_b_proj.weight`` read every call (no copy, so
they are never stale after a weight reload).
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.backends.common.merge import merge_attn_states
from attnplug.backends.mla.common.cache import concat_and_cache_mla, gather_latent
from attnplug.core.errors import MetadataError
from attnplug.core.mla import MLAContextChunk, MLAImpl, MLALayerConfig, MLAMetadata, MLAPrefillMetadata


class MLACommonImpl(MLAImpl):
    """The shared ``forward``; subclasses implement ``forward_mqa`` and ``forward_mha``.

    Raises (constructor):
        MetadataError: inconsistent dimensions (each problem named).
    """

    def __init__(self, layer_config: MLALayerConfig, scale: float):
        problems = layer_config.problems()
        if problems:
            raise MetadataError("MLA layer: " + "; ".join(problems))
        super().__init__(layer_config, scale)
        self._workspace: torch.Tensor | None = None

    # --- pieces a backend may override -----------------------------------------------------
    def write_cache(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    md: MLAMetadata) -> None:
        """Write this step's latent rows (default: :func:`concat_and_cache_mla`)."""
        concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, md.slot_mapping)

    def workspace(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A ``[>= rows, L + R]`` buffer of ``like``'s dtype and device, reused across calls."""
        ws = self._workspace
        if ws is None or ws.shape[0] < rows or ws.dtype != like.dtype or ws.device != like.device:
            ws = self._workspace = torch.empty(rows, like.shape[-1], dtype=like.dtype, device=like.device)
        return ws

    # --- the step ------------------------------------------------------------------------------
    def forward(self, layer: Any, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: MLAMetadata, output: torch.Tensor) -> torch.Tensor:
        md = attn_metadata
        w_kv = self._kv_b(layer)
        self.write_cache(kv_c_normed, k_pe, kv_cache, md)
        if md.decode is not None:
            d = md.num_decode_tokens
            output[:d] = self._decode(q[:d], kv_cache, md, w_kv)
        if md.prefill is not None:
            p0, p1 = md.num_decode_tokens, md.num_actual_tokens
            output[p0:p1] = self._prefill(q[p0:p1], kv_c_normed[p0:p1], k_pe[p0:p1], kv_cache, md.prefill, w_kv)
        return output

    def _kv_b(self, layer: Any) -> torch.Tensor:
        """``kv_b_proj.weight`` as ``[N, P + V, L]`` (a view)."""
        w = layer.kv_b_proj.weight
        n, p, v, lr = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        if tuple(w.shape) != (n * (p + v), lr):
            raise MetadataError(f"kv_b_proj.weight {tuple(w.shape)} must be [num_heads * (qk_nope_head_dim + "
                                f"v_head_dim), kv_lora_rank] = [{n * (p + v)}, {lr}]")
        return w.view(n, p + v, lr)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: MLAMetadata, w_kv: torch.Tensor) -> torch.Tensor:
        p = self.qk_nope_head_dim
        w_uk, w_uv = w_kv[:, :p], w_kv[:, p:]                      # [N, P, L], [N, V, L]
        ql_nope = torch.einsum("bnp,npl->bnl", q[..., :p], w_uk.to(q.dtype))
        q_lat = torch.cat([ql_nope, q[..., p:]], dim=-1).to(kv_cache.dtype)
        o_lat, _ = self.forward_mqa(q_lat, kv_cache, md.decode)
        return self.up_project_output(o_lat.to(q.dtype), w_uv.to(q.dtype))

    def up_project_output(self, o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """``[B, N, L] x [N, V, L] -> [B, N, V]``: the absorbed ``W_UV``."""
        return torch.einsum("bnl,nvl->bnv", o_lat, w_uv)

    def _expand(self, latent: torch.Tensor, k_pe: torch.Tensor, w_kv: torch.Tensor, dtype: torch.dtype):
        """Up-project latents ``[T, L]`` + ``k_pe`` ``[T, R]`` to ``k`` ``[T, N, P+R]``, ``v`` ``[T, N, V]``."""
        p = self.qk_nope_head_dim
        kv = torch.einsum("tl,nkl->tnk", latent.to(dtype), w_kv.to(dtype))
        k_nope, v = kv[..., :p], kv[..., p:]
        k = torch.cat([k_nope, k_pe.to(dtype).reshape(-1, 1, self.qk_rope_head_dim).expand(-1, self.num_heads, -1)],
                      dim=-1)
        return k, v.contiguous()

    def _prefill(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 pre: MLAPrefillMetadata, w_kv: torch.Tensor) -> torch.Tensor:
        k, v = self._expand(kv_c, k_pe, w_kv, q.dtype)
        out, lse = self.forward_mha(q, k, v, pre.query_start_loc, pre.query_start_loc, pre.max_query_len,
                                    pre.max_query_len, causal=True)
        for chunk in pre.chunks:
            o_c, lse_c = self._context_chunk(q, kv_cache, pre, chunk, w_kv)
            out, lse = self.merge(out, lse, o_c, lse_c)
        return out

    def _context_chunk(self, q: torch.Tensor, kv_cache: torch.Tensor, pre: MLAPrefillMetadata,
                       chunk: MLAContextChunk, w_kv: torch.Tensor):
        rows = gather_latent(kv_cache, chunk.slots, self.workspace(pre.workspace_tokens, kv_cache))
        k, v = self._expand(rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank:], w_kv, q.dtype)
        return self.forward_mha(q, k, v, pre.query_start_loc, chunk.cu_seq_lens, pre.max_query_len,
                                chunk.max_seq_len, causal=False)

    @staticmethod
    def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
        """Attention over two disjoint key sets from the parts: ``(out, lse)`` (lse ``[N, T]``)."""
        out = merge_attn_states(out_a, lse_a, out_b, lse_b)
        return out, torch.logaddexp(lse_a.float(), lse_b.float())
