"""``gdn_fla``: the GDN rule lowered to flash-linear-attention's documented entry points.

``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (the prefill part) and
``fused_recurrent_gated_delta_rule`` (decode rows), both called varlen: every tensor
``[1, T, heads, dim]``, ``cu_seqlens`` ``[N + 1]`` int64 token offsets, ``initial_state``
``[N, HV, K, V]`` float32 with ``output_final_state=True``, q/k handed raw (``H`` key heads:
the kernels l2-normalise them with ``use_qk_l2norm_in_kernel=True``, scale q by ``K ** -0.5``
and map value head ``hv`` to key head ``hv // (HV // H)``), ``g`` in log space and ``beta``
``[1, T, HV]`` (flash-linear-attention's docstrings; facts, not code). Conv, gates and slot
handling are :class:`~attnplug.backends.state.gdn.impl.GDNTorchImpl`'s.

The package runs on CUDA only; ``attnplug.backends.emulators`` wires this impl to CPU
emulators of the two entry points so the lowering is tested here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from attnplug.backends.state.gdn.impl import GDNTorchImpl
from attnplug.backends.state.gdn.metadata import GDNMetadata


class FlaKernels(NamedTuple):
    """The two flash-linear-attention entry points the impl calls."""

    chunk_gated_delta_rule: Callable
    fused_recurrent_gated_delta_rule: Callable


def load_fla_kernels() -> FlaKernels | None:
    """The installed package's entry points, or ``None`` when ``fla`` does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # not installed, or a broken install
        return None
    return FlaKernels(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)


class GDNFlaImpl(GDNTorchImpl):
    """The GDN core with the rule in flash-linear-attention (see the module docstring)."""

    raw_qk = True

    @classmethod
    def load_kernels(cls) -> FlaKernels | None:
        """The entry points this impl calls (the emulated impl returns the emulator's)."""
        return load_fla_kernels()

    def __init__(self, layer_config):
        super().__init__(layer_config)
        self.kernels = self.load_kernels()
        if self.kernels is None:
            raise RuntimeError("gdn_fla needs flash-linear-attention: pip install flash-linear-attention (CUDA)")

    def _call(self, fn, q, k, v, g, beta, initial_state, cu_seqlens):
        o, final = fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                      scale=self.layer_config.head_k_dim ** -0.5, initial_state=initial_state.contiguous(),
                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        return o[0].float(), final

    def decode_rule(self, state, q, k, v, g, beta):
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int64, device=q.device)
        return self._call(self.kernels.fused_recurrent_gated_delta_rule, q, k, v, g, beta, state, cu)

    def prefill_rule(self, q, k, v, g, beta, initial_state, md: GDNMetadata):
        cu = md.query_start_loc_p.to(torch.int64)
        return self._call(self.kernels.chunk_gated_delta_rule, q, k, v, g, beta, initial_state, cu)
