"""``Mamba2Impl``: conv1d + SSM of one Mamba2 layer over its state slots, one step.

Decode rows (the first ``num_decodes``) take the recurrent path: one conv1d step and one
state update per row. The prefill part takes the varlen causal conv1d and the chunked SSD
scan, each sequence starting from its slot's state when ``has_initial_state`` (a
chunked-prefill continuation) and from zeros otherwise. Final states are written back to
the slots. The slots of rows without an initial state (``fresh_rows``: new requests,
including one-token prompts on the decode path) are zeroed first, so a slot's stale
contents from its previous owner are never read.

Time steps are ``clamp(softplus(dt + dt_bias), *time_step_limit)`` on both paths (HF and
mamba_ssm clamp only in the chunked scan; one definition keeps a decode step equal to the
same token inside a prefill). Math in float32; states are stored in the cache's dtypes
(conv: ``MambaSpec.dtype``, SSM: ``MambaSpec.ssm_dtype``). On CUDA, when ``mamba_ssm``
and ``causal_conv1d`` import, the decode conv/update and the per-request prefill scans
use their kernels (``backends.mamba2.kernels``; untested here).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from attnplug.backends.mamba2 import ops
from attnplug.backends.mamba2.kernels import MambaKernels, load_kernels
from attnplug.backends.mamba2.metadata import Mamba2Metadata
from attnplug.core.errors import BackendUnsupportedError
from attnplug.core.mamba import MambaImpl, MambaLayerConfig, MambaStateCache


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of ``cache`` as a fresh float32 tensor (safe to update in place)."""
    st = cache.index_select(0, slots)
    return st if st.dtype == torch.float32 else st.float()


class Mamba2Impl(MambaImpl):
    """The torch Mamba2 mixer core (see :class:`~attnplug.core.mamba.MambaImpl`).

    Args:
        layer_config: the layer's :class:`MambaLayerConfig`.
        use_kernels: ``None`` (default) uses the upstream kernels when the layer is on CUDA
            and they import; ``False`` never; ``True`` requires them.

    Raises:
        BackendUnsupportedError: ``use_kernels=True`` but the kernels are unavailable.
    """

    def __init__(self, layer_config: MambaLayerConfig, use_kernels: bool | None = None):
        super().__init__(layer_config)
        on_cuda = torch.device(layer_config.device).type == "cuda"
        kernels = load_kernels() if on_cuda and use_kernels is not False else None
        if use_kernels and kernels is None:
            raise BackendUnsupportedError("mamba2_torch", [
                "use_kernels=True needs a CUDA layer and importable mamba_ssm + causal_conv1d "
                "(pip install 'attnplug[mamba]')"])
        self.kernels: MambaKernels | None = kernels
        lo, hi = layer_config.time_step_limit
        self._clamp = None if (lo, hi) == (0.0, math.inf) else (float(lo), float(hi))

    def forward(self, layer: Any, hidden_states_B_C: torch.Tensor, dt: torch.Tensor,
                state: MambaStateCache, attn_metadata: Mamba2Metadata, output: torch.Tensor) -> torch.Tensor:
        """See :meth:`MambaImpl.forward`. No host synchronisation."""
        md = attn_metadata
        if md.num_actual_tokens == 0:
            return output
        cfg = self.layer_config
        weight = layer.conv1d.weight.reshape(cfg.conv_dim, cfg.conv_kernel_size).float()
        bias = None if layer.conv1d.bias is None else layer.conv1d.bias.float()
        params = (weight, bias, -torch.exp(layer.A_log.float()), layer.D.float(), layer.dt_bias.float())
        slots = md.state_indices[:md.num_reqs].long()
        fresh = slots.index_select(0, md.fresh_rows)
        state.conv_state.index_fill_(0, fresh, 0)   # a new owner starts from zeros
        state.ssm_state.index_fill_(0, fresh, 0)
        nd, T = md.num_decodes, md.num_actual_tokens
        if nd:
            y = self._decode(hidden_states_B_C[:nd], dt[:nd], state, slots[:nd], params)
            output[:nd] = y.reshape(nd, cfg.intermediate_size).to(output.dtype)
        if md.num_verify_rows:  # speculative decoding: plain prefill rows gathered, then the verifying rows
            if md.num_prefills:
                ti = md.prefill_token_index
                y = self._prefill(hidden_states_B_C.index_select(0, ti), dt.index_select(0, ti), state,
                                  slots.index_select(0, md.prefill_rows), params, md)
                output.index_copy_(0, ti, y.reshape(ti.shape[0], cfg.intermediate_size).to(output.dtype))
            self._verify(hidden_states_B_C, dt, state, slots, params, md, output)
        elif md.num_prefills:
            y = self._prefill(hidden_states_B_C[nd:T], dt[nd:T], state, slots[nd:], params, md)
            output[nd:T] = y.reshape(T - nd, cfg.intermediate_size).to(output.dtype)
        return output

    # --- verifying rows (speculative decoding, backends/mamba2/verify.py) ----------------------
    def _verify(self, xbc, dt, state: MambaStateCache, slots, params, md: Mamba2Metadata, output) -> None:
        """The recurrent update at each position of every verifying row; the state after
        position ``t`` goes to the row's block-table column ``t``, the outputs to their tokens."""
        weight, bias, A, D, dt_bias = params
        cfg = self.layer_config
        Rv, L = md.num_verify_rows, md.max_verify_len
        ti = md.verify_token_index
        x_all = xbc.index_select(0, ti).float().view(Rv, L, -1)
        dt_all = self._time_step(dt.index_select(0, ti).view(Rv, L, -1), dt_bias)
        own = slots.index_select(0, md.verify_rows)
        conv = _gather(state.conv_state, own)
        ssm0 = _gather(state.ssm_state, own)
        # the state after each position, [Rv, L, ...]: the update runs in place in its column t
        ssm_all = ssm0.new_empty((Rv, L, *ssm0.shape[1:]))
        conv_all = conv.new_empty((Rv, L, *conv.shape[1:]))
        y_all = x_all.new_empty((Rv, L, cfg.intermediate_size))
        for t in range(L):
            out, conv = ops.causal_conv1d_decode(x_all[:, t], weight, bias, conv)
            conv_all[:, t] = conv
            x, B, C = self._split(F.silu(out))
            ssm = ssm_all[:, t]
            ssm.copy_(ssm0 if t == 0 else ssm_all[:, t - 1])
            y, _ = ops.selective_state_update(ssm, x, dt_all[:, t], A, B, C)
            y_all[:, t] = (y + D[:, None] * x).reshape(Rv, cfg.intermediate_size)
        w, dst = md.verify_write_index, md.verify_write_slots
        state.conv_state.index_copy_(0, dst, conv_all.flatten(0, 1).index_select(0, w).to(state.conv_state.dtype))
        state.ssm_state.index_copy_(0, dst, ssm_all.flatten(0, 1).index_select(0, w).to(state.ssm_state.dtype))
        output.index_copy_(0, ti.index_select(0, w), y_all.flatten(0, 1).index_select(0, w).to(output.dtype))

    # --- shared pieces ----------------------------------------------------------------------
    def _time_step(self, dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt.float() + dt_bias)
        return dt if self._clamp is None else dt.clamp(*self._clamp)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.layer_config
        n = xbc.shape[0]
        gs = cfg.n_groups * cfg.state_size
        x, B, C = xbc.split([cfg.intermediate_size, gs, gs], dim=-1)
        return (x.reshape(n, cfg.num_heads, cfg.head_size), B.reshape(n, cfg.n_groups, cfg.state_size),
                C.reshape(n, cfg.n_groups, cfg.state_size))

    # --- decode rows --------------------------------------------------------------------------
    def _decode(self, xbc, dt, state: MambaStateCache, slots, params) -> torch.Tensor:
        weight, bias, A, D, dt_bias = params
        conv = _gather(state.conv_state, slots)
        ssm = _gather(state.ssm_state, slots)
        if self.kernels is not None:
            y = self._decode_kernels(xbc, dt, conv, ssm, params)
        else:
            out, conv = ops.causal_conv1d_decode(xbc.float(), weight, bias, conv)
            x, B, C = self._split(F.silu(out))
            y, ssm = ops.selective_state_update(ssm, x, self._time_step(dt, dt_bias), A, B, C)
            y = y + D[:, None] * x
        state.conv_state.index_copy_(0, slots, conv.to(state.conv_state.dtype))
        state.ssm_state.index_copy_(0, slots, ssm.to(state.ssm_state.dtype))
        return y

    def _decode_kernels(self, xbc, dt, conv, ssm, params) -> torch.Tensor:
        """Upstream kernels; ``conv`` and ``ssm`` (gathered copies) are updated in place."""
        weight, bias, A, D, dt_bias = params
        cfg = self.layer_config
        h, p, n = cfg.ssm_state_shape
        out = self.kernels.causal_conv1d_update(xbc.float(), conv, weight, bias, activation="silu")
        x, B, C = self._split(out)
        dt = self._time_step(dt, dt_bias)  # bias, softplus and clamp here: the kernel cannot clamp
        return self.kernels.selective_state_update(
            ssm, x, dt[:, :, None].expand(-1, h, p), A[:, None, None].expand(h, p, n), B, C,
            D=D[:, None].expand(h, p), z=None, dt_bias=None, dt_softplus=False)

    # --- prefill part ---------------------------------------------------------------------------
    def _prefill(self, xbc, dt, state: MambaStateCache, slots, params, md: Mamba2Metadata) -> torch.Tensor:
        weight, bias, A, D, dt_bias = params
        conv0 = _gather(state.conv_state, slots)
        ssm0 = _gather(state.ssm_state, slots)
        out, conv = ops.causal_conv1d_prefill(xbc.float(), weight, bias, conv0, md.conv_token_pos,
                                              md.conv_state_pos, md.conv_final_pos, md.conv_window_pos)
        x, B, C = self._split(F.silu(out))
        if self.kernels is not None:
            y, ssm = self._prefill_kernels(x, dt, A, B, C, ssm0, params, md)
        else:
            y, ssm = ops.ssd_chunk_scan(x, self._time_step(dt, dt_bias), A, B, C, ssm0, md.chunk_token_index,
                                        md.token_chunk_index, md.chunk_grid_index, chunk_size=md.chunk_size,
                                        max_chunks_per_seq=md.max_chunks_per_seq)
            y = y + D[:, None] * x
        state.conv_state.index_copy_(0, slots, conv.to(state.conv_state.dtype))
        state.ssm_state.index_copy_(0, slots, ssm.to(state.ssm_state.dtype))
        return y

    def _prefill_kernels(self, x, dt, A, B, C, ssm0, params, md: Mamba2Metadata):
        """One upstream chunked scan per prefill request (bounds from the host copy)."""
        _, _, _, D, dt_bias = params
        qsl = md.query_start_loc_p_cpu
        limit = self._clamp or (0.0, math.inf)
        y = torch.empty_like(x)
        finals = []
        for i in range(md.num_prefills):
            s, e = int(qsl[i]), int(qsl[i + 1])
            if e == s:
                finals.append(ssm0[i])
                continue
            y_i, f_i = self.kernels.mamba_chunk_scan_combined(
                x[None, s:e], dt.float()[None, s:e], A, B[None, s:e], C[None, s:e], md.chunk_size, D=D, z=None,
                dt_bias=dt_bias, initial_states=ssm0[i:i + 1], dt_softplus=True, dt_limit=limit,
                return_final_states=True)
            y[s:e] = y_i[0]
            finals.append(f_i[0])
        return y, torch.stack(finals)
