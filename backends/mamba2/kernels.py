"""Optional CUDA kernels from ``mamba_ssm`` / ``causal_conv1d`` (``pip install 'attnplug[mamba]'``).

Imported lazily, only for layers on CUDA. Upstream signatures (mamba_ssm >= 2.2,
causal_conv1d >= 1.4) used here:

* ``selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
  dt_softplus=False)`` — state ``[batch, nheads, headdim, dstate]`` updated in place;
  ``x`` ``[batch, nheads, headdim]``; ``dt`` ``[batch, nheads, headdim]``; ``A``
  ``[nheads, headdim, dstate]``; ``B``/``C`` ``[batch, ngroups, dstate]``; ``D``/``dt_bias``
  ``[nheads, headdim]``.
* ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
  initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=...,
  return_final_states=False)`` — ``x`` ``[batch, seqlen, nheads, headdim]``; upstream
  takes one initial state per *batch row*, so packed sequences with their own initial
  states are scanned one request at a time (a loop over requests, not tokens).
* ``causal_conv1d_update(x, conv_state, weight, bias=None, activation=None)`` — ``x``
  ``[batch, dim]``, ``conv_state`` ``[batch, dim, width - 1]`` updated in place.

The prefill conv1d always runs in torch (``ops.causal_conv1d_prefill``): upstream
``causal_conv1d_fn`` cannot combine packed sequences with per-sequence initial states.

This path is NOT exercised by attnplug's tests (the packages do not install on the
CPU-only CI); the torch path is the reference it must match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class MambaKernels:
    """The upstream kernel entry points."""

    selective_state_update: Callable[..., Any]
    mamba_chunk_scan_combined: Callable[..., Any]
    causal_conv1d_update: Callable[..., Any]


_CACHE: dict[str, MambaKernels | None] = {}


def load_kernels() -> MambaKernels | None:
    """The kernels if ``mamba_ssm`` and ``causal_conv1d`` import, else ``None``. Cached;
    never raises."""
    if "k" not in _CACHE:
        try:
            from causal_conv1d import causal_conv1d_update
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except Exception:  # ImportError, or a broken CUDA extension build
            _CACHE["k"] = None
        else:
            _CACHE["k"] = MambaKernels(selective_state_update, mamba_chunk_scan_combined, causal_conv1d_update)
    return _CACHE["k"]
