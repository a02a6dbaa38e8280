"""Triton kernel of the gated delta rule: the fused recurrent form over packed sequences.

Imported only through :func:`attnplug.backends.triton.runtime.kernel_module` (so that it is
decorated in the mode Triton runs in: compiled, or the interpreter on the CPU); the Python
entry point is ``triton_ops.fused_recurrent_gated_delta_rule``.

One program per (sequence, value head) keeps the head's state ``S`` ``[DK, DV]`` in
registers and walks the sequence's tokens in order (the recurrence in ``ops.py``)::

    S *= exp(g_t);   S += k_t outer beta_t (v_t - S^T k_t);   o_t = S^T q_t
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnplug.backends.triton.runtime import interpreting

INTERPRETED: bool = interpreting()
"""Whether the kernel below was decorated for the Triton interpreter."""


@triton.jit
def fused_recurrent_gdn_kernel(
    q_ptr, k_ptr,        # [T, H, DK] float32, contiguous (l2-normalised, q scaled)
    v_ptr,               # [T, H, DV] float32, contiguous
    g_ptr, beta_ptr,     # [T, H] float32, contiguous
    o_ptr,               # [T, H, DV] float32, written
    state_ptr,           # [N, H, DK, DV] float32: initial states, overwritten with the final ones
    cu_seqlens_ptr,      # [N + 1] int32: token offsets of the sequences
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_ptrs = state_ptr + ((seq * H + h) * DK + offs_k[:, None]) * DV + offs_v[None, :]
    S = tl.load(s_ptrs, mask=mask_s, other=0.0)
    for t in range(start, end):
        row = t * H + h
        q = tl.load(q_ptr + row * DK + offs_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + row * DK + offs_k, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + row * DV + offs_v, mask=mask_v, other=0.0)
        g = tl.load(g_ptr + row)
        beta = tl.load(beta_ptr + row)
        S = S * tl.exp(g)
        kv = tl.sum(S * k[:, None], axis=0)                 # S^T k: [BV]
        delta = (v - kv) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)                  # S^T q: [BV]
        tl.store(o_ptr + row * DV + offs_v, o, mask=mask_v)
    tl.store(s_ptrs, S, mask=mask_s)
