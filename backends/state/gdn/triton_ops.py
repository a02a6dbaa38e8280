"""Python entry point of the Triton gated-delta-rule kernel (``triton_kernels.py``)."""

from __future__ import annotations

import torch

from attnplug.backends.triton.runtime import kernel_module, launch

_PACKAGE = "attnplug.backends.state.gdn"


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: torch.Tensor,
                                     cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over packed sequences, one Triton program per (sequence, value head).

    Args:
        q, k: ``[T, H, dk]``; v: ``[T, H, dv]``; g, beta: ``[T, H]`` (float32; q/k
            l2-normalised and expanded to the value heads, q scaled by ``dk ** -0.5``).
        initial_state: ``[N, H, dk, dv]`` float32.
        cu_seqlens: ``[N + 1]`` integer token offsets of the ``N`` sequences (device).

    Returns:
        ``(o [T, H, dv] float32, final_state [N, H, dk, dv] float32)`` (new tensors).

    Raises:
        ImportError: Triton is not importable.
    """
    T, H, DK = q.shape
    DV = v.shape[-1]
    N = initial_state.shape[0]
    out = torch.zeros((T, H, DV), dtype=torch.float32, device=q.device)
    state = initial_state.float().contiguous().clone()
    if N == 0 or T == 0:
        return out, state
    mod = kernel_module("triton_kernels", _PACKAGE)
    f32 = [t.float().contiguous() for t in (q, k, v, g, beta)]
    launch(mod, "fused_recurrent_gdn_kernel", (N, H), *f32, out, state, cu_seqlens.to(torch.int32).contiguous(),
           H=H, DK=DK, DV=DV, BK=max(16, 1 << (DK - 1).bit_length()), BV=max(16, 1 << (DV - 1).bit_length()))
    return out, state
