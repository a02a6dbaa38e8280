"""CPU emulator of flash-linear-attention's gated-delta-rule entry points — a TEST TOOL.

``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` as their docstrings
document them (``fla.ops.gated_delta_rule``; facts, not code), for the varlen call the
``gdn_fla`` impl makes: ``q``, ``k`` ``[1, T, H, K]``, ``v`` ``[1, T, HV, V]`` with ``HV`` a
multiple of ``H`` (value head ``hv`` reads key head ``hv // (HV // H)``), ``g`` (log decay)
and ``beta`` ``[1, T, HV]``, ``scale`` (default ``K ** -0.5``), ``initial_state`` ``[N, HV,
K, V]``, ``cu_seqlens`` ``[N + 1]`` int64 from 0 to ``T``, non-decreasing;
``use_qk_l2norm_in_kernel`` normalises q and k over ``K`` first. Returns ``(o [1, T, HV,
V]`` in v's dtype, ``final_state [N, HV, K, V]`` float32 or ``None)``.

Every argument is checked against that contract first (:class:`FlaContractError` naming
it), then the result is computed token by token per sequence (``ops.recurrent_gated_delta_rule``),
an algorithm independent of the chunked form the torch backend uses. Each call is logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnplug.backends.state.gdn import ops
from attnplug.backends.state.gdn.fla import FlaKernels
from attnplug.core.errors import AttnplugError


class FlaContractError(AttnplugError, ValueError):
    """An argument the flash-linear-attention entry point would reject or misread."""


def _check(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    def need(ok: bool, what: str):
        if not ok:
            raise FlaContractError(what)
    need(q.dim() == 4 and q.shape == k.shape, f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, T, H, K] alike")
    need(v.dim() == 4 and v.shape[:2] == q.shape[:2], f"v {tuple(v.shape)} must be [B, T, HV, V] with q's B, T")
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    need(HV % H == 0, f"HV {HV} must be a multiple of H {H}")
    need(g.shape == (B, T, HV) and beta.shape == (B, T, HV), f"g {tuple(g.shape)} and beta {tuple(beta.shape)} "
                                                             f"must be [B, T, HV] = {(B, T, HV)}")
    need(cu_seqlens is not None, "cu_seqlens is required for packed sequences")
    need(B == 1, f"the batch size must be 1 with cu_seqlens, got {B}")
    need(cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1, f"cu_seqlens must be 1-D int64 (LongTensor), "
                                                                     f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    need(cu[0] == 0 and cu[-1] == T and all(a <= b for a, b in zip(cu, cu[1:])),
         f"cu_seqlens {cu} must run from 0 to T={T}, non-decreasing")
    N = len(cu) - 1
    need(initial_state is not None and tuple(initial_state.shape) == (N, HV, K, V),
         f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, got "
         f"{None if initial_state is None else tuple(initial_state.shape)}")


def _rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    H, HV = q.shape[2], v.shape[2]
    qf, kf = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        qf, kf = ops.l2norm(qf), ops.l2norm(kf)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = (qf * scale).repeat_interleave(HV // H, dim=1), kf.repeat_interleave(HV // H, dim=1)
    vf, gf, bf = v[0].float(), g[0].float(), beta[0].float()
    out = torch.zeros_like(vf)
    finals = []
    cu = cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        out[s:e], f = ops.recurrent_gated_delta_rule(qf[s:e], kf[s:e], vf[s:e], gf[s:e], bf[s:e],
                                                     initial_state[i].float())
        finals.append(f)
    final = torch.stack(finals) if output_final_state else None
    return out.to(v.dtype).unsqueeze(0), final


@dataclass
class FlaEmulator:
    """The emulated entry points, with a log of ``(entry point, cu_seqlens list)`` per call."""

    calls: list[tuple[str, list[int]]] = field(default_factory=list)

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        """The emulated ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (module docstring)."""
        out = _rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
        self.calls.append(("chunk_gated_delta_rule", cu_seqlens.tolist()))
        return out

    def fused_recurrent_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None,
                                         output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        """The emulated ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule``."""
        out = _rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
        self.calls.append(("fused_recurrent_gated_delta_rule", cu_seqlens.tolist()))
        return out

    def kernels(self) -> FlaKernels:
        return FlaKernels(self.chunk_gated_delta_rule, self.fused_recurrent_gated_delta_rule)


FLA_EMULATOR = FlaEmulator()
"""The emulator the :class:`GDNFlaEmulatedBackend` impl calls (its ``calls`` log is shared)."""
