"""``GDNTorchImpl``: the Gated DeltaNet layer core in plain torch (reference implementation).

Decode rows: one conv step and one recurrent step each (batched). Verifying rows
(speculative decoding): one conv step and one recurrent step per position, the states
after each position kept (``_verify``). Prefill part: the
varlen causal conv1d continuing from each slot's conv state (``backends.mamba2.ops``,
shared with Mamba2) and the chunked gated delta rule with per-sequence initial states
(``ops.chunk_gated_delta_rule``). Slots of rows without an initial state are zeroed
first. Math in float32; the recurrent state is kept in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from attnplug.backends.mamba2.ops import causal_conv1d_decode, causal_conv1d_prefill
from attnplug.backends.state.gdn import ops
from attnplug.backends.state.gdn.metadata import GDNMetadata
from attnplug.core.gdn import GDNImpl, GDNStateCache


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of ``cache`` as a fresh float32 tensor (safe to update in place)."""
    st = cache.index_select(0, slots)
    return st if st.dtype == torch.float32 else st.float()


class GDNTorchImpl(GDNImpl):
    """The torch GDN core (see :class:`~attnplug.core.gdn.GDNImpl`).

    ``raw_qk = True`` (a subclass whose rule normalises, scales and expands q/k itself, as
    flash-linear-attention's kernels do) hands the rule q and k as ``[n, num_k_heads,
    head_k_dim]`` straight from the conv.
    """

    raw_qk = False

    def forward(self, layer: Any, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                state: GDNStateCache, attn_metadata: GDNMetadata, output: torch.Tensor) -> torch.Tensor:
        """See :meth:`GDNImpl.forward`. No host synchronisation."""
        md = attn_metadata
        if md.num_actual_tokens == 0:
            return output
        cfg = self.layer_config
        weight = layer.conv1d.weight.reshape(cfg.conv_dim, cfg.conv_kernel_size).float()
        bias = None if layer.conv1d.bias is None else layer.conv1d.bias.float()
        neg_A = -torch.exp(layer.A_log.float())
        slots = md.state_indices[:md.num_reqs].long()
        fresh = slots.index_select(0, md.fresh_rows)
        state.conv_state.index_fill_(0, fresh, 0)     # a new owner starts from zeros
        state.recurrent_state.index_fill_(0, fresh, 0)
        nd, T = md.num_decodes, md.num_actual_tokens
        gates = (neg_A, layer.dt_bias.float())
        if nd:
            conv = _gather(state.conv_state, slots[:nd])
            x, conv = causal_conv1d_decode(mixed_qkv[:nd].float(), weight, bias, conv)
            q, k, v, g, beta = self._inputs(F.silu(x), a[:nd], b[:nd], gates)
            rec = _gather(state.recurrent_state, slots[:nd])
            o, rec = self.decode_rule(rec, q, k, v, g, beta)
            self._write(state, slots[:nd], conv, rec)
            output[:nd] = o.to(output.dtype)
        if md.num_verify_rows:  # speculative decoding: plain prefill rows gathered, then the verifying rows
            if md.num_prefills:
                ti = md.prefill_token_index
                o = self._prefill(mixed_qkv.index_select(0, ti), a.index_select(0, ti), b.index_select(0, ti),
                                  state, slots.index_select(0, md.prefill_rows), weight, bias, gates, md)
                output.index_copy_(0, ti, o.to(output.dtype))
            self._verify(mixed_qkv, a, b, state, slots, weight, bias, gates, md, output)
        elif md.num_prefills:
            o = self._prefill(mixed_qkv[nd:T], a[nd:T], b[nd:T], state, slots[nd:], weight, bias, gates, md)
            output[nd:T] = o.to(output.dtype)
        return output

    def _verify(self, qkv, a, b, state: GDNStateCache, slots, weight, bias, gates, md: GDNMetadata,
                output) -> None:
        """Verifying rows (speculative decoding, ``backends/mamba2/verify.py``'s layout): one
        conv step and one :meth:`decode_rule` step per position over all verifying rows; the
        conv and recurrent states after position ``t`` go to the row's block-table column
        ``t`` (``md.verify_write_slots``), the outputs to their tokens."""
        Rv, L = md.num_verify_rows, md.max_verify_len
        ti = md.verify_token_index
        x_all = qkv.index_select(0, ti).float().view(Rv, L, -1)
        a_all, b_all = a.index_select(0, ti).view(Rv, L, -1), b.index_select(0, ti).view(Rv, L, -1)
        own = slots.index_select(0, md.verify_rows)
        conv = _gather(state.conv_state, own)
        rec = _gather(state.recurrent_state, own)
        conv_all = conv.new_empty((Rv, L, *conv.shape[1:]))
        rec_all = rec.new_empty((Rv, L, *rec.shape[1:]))
        o_all = rec.new_empty((Rv, L, self.layer_config.num_v_heads, self.layer_config.head_v_dim))
        for t in range(L):
            x, conv = causal_conv1d_decode(x_all[:, t], weight, bias, conv)
            conv_all[:, t] = conv
            q, k, v, g, beta = self._inputs(F.silu(x), a_all[:, t], b_all[:, t], gates)
            o, rec = self.decode_rule(rec, q, k, v, g, beta)
            rec_all[:, t] = rec
            o_all[:, t] = o
        w, dst = md.verify_write_index, md.verify_write_slots
        state.conv_state.index_copy_(0, dst, conv_all.flatten(0, 1).index_select(0, w).to(state.conv_state.dtype))
        state.recurrent_state.index_copy_(
            0, dst, rec_all.flatten(0, 1).index_select(0, w).to(state.recurrent_state.dtype))
        output.index_copy_(0, ti.index_select(0, w), o_all.flatten(0, 1).index_select(0, w).to(output.dtype))

    def _inputs(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, gates):
        """Conv output ``[n, conv_dim]`` -> l2-normalised, scaled, head-expanded q, k; v; g; beta."""
        cfg = self.layer_config
        n = x.shape[0]
        q, k, v = x.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        rep = cfg.num_v_heads // cfg.num_k_heads
        q, k = q.reshape(n, cfg.num_k_heads, cfg.head_k_dim), k.reshape(n, cfg.num_k_heads, cfg.head_k_dim)
        if not self.raw_qk:
            q, k = ops.l2norm(q) * cfg.head_k_dim ** -0.5, ops.l2norm(k)
            if rep > 1:
                q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        neg_A, dt_bias = gates
        g = neg_A * F.softplus(a.float() + dt_bias)
        return q, k, v.reshape(n, cfg.num_v_heads, cfg.head_v_dim), g, torch.sigmoid(b.float())

    @staticmethod
    def _write(state: GDNStateCache, slots: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> None:
        state.conv_state.index_copy_(0, slots, conv.to(state.conv_state.dtype))
        state.recurrent_state.index_copy_(0, slots, rec.to(state.recurrent_state.dtype))

    def _prefill(self, qkv, a, b, state: GDNStateCache, slots, weight, bias, gates, md: GDNMetadata):
        conv0 = _gather(state.conv_state, slots)
        x, conv = causal_conv1d_prefill(qkv.float(), weight, bias, conv0, md.conv_token_pos, md.conv_state_pos,
                                        md.conv_final_pos, md.conv_window_pos)
        q, k, v, g, beta = self._inputs(F.silu(x), a, b, gates)
        rec0 = _gather(state.recurrent_state, slots)
        o, rec = self.prefill_rule(q, k, v, g, beta, rec0, md)
        self._write(state, slots, conv, rec)
        return o

    # --- the rule itself: what another implementation (Triton, a library) replaces -----------
    def decode_rule(self, state, q, k, v, g, beta):
        """One token per row: ``state`` ``[n, H, dk, dv]`` (a float32 copy, may be updated in
        place), ``q``/``k`` ``[n, H, dk]``, ``v`` ``[n, H, dv]``, ``g``/``beta`` ``[n, H]`` ->
        ``(o [n, H, dv], new state)``."""
        return ops.gated_delta_step(state, q, k, v, g, beta)

    def prefill_rule(self, q, k, v, g, beta, initial_state, md: GDNMetadata):
        """The prefill part's packed sequences (``md``'s layout) from ``initial_state``
        ``[num_prefills, H, dk, dv]`` -> ``(o [num_prefill_tokens, H, dv], final states)``."""
        return ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state, md.chunk_token_index,
                                          md.token_chunk_index, md.chunk_grid_index, chunk_size=md.chunk_size,
                                          max_chunks_per_seq=md.max_chunks_per_seq)


class GDNTritonImpl(GDNTorchImpl):
    """The GDN core with the rule in Triton (``triton_ops.fused_recurrent_gated_delta_rule``):
    decode rows and the prefill part's sequences each run the fused recurrence; conv, gates
    and slot handling are :class:`GDNTorchImpl`'s."""

    def decode_rule(self, state, q, k, v, g, beta):
        from attnplug.backends.state.gdn.triton_ops import fused_recurrent_gated_delta_rule

        n = q.shape[0]
        cu = torch.arange(n + 1, dtype=torch.int32, device=q.device)
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, cu)

    def prefill_rule(self, q, k, v, g, beta, initial_state, md: GDNMetadata):
        from attnplug.backends.state.gdn.triton_ops import fused_recurrent_gated_delta_rule

        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, md.query_start_loc_p)
