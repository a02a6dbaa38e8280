"""CPU emulator of FlashMLA's token-level sparse kernel, ``flash_mla_sparse_fwd`` — a TEST TOOL.

The documented contract (FlashMLA ``flash_mla_interface.py``), checked argument by argument
(:class:`~attnplug.backends.emulators.mla_kernels.MLAContractError` names what breaks it),
then computed in float32:

* ``q`` ``[s_q, h_q, d_qk]``, ``h_q`` a multiple of 64; ``kv`` ``[s_kv, h_kv, d_qk]`` with
  ``h_kv == 1``, the same dtype (the real kernel: bfloat16 only; the emulator also takes
  float32/float16 so the tiny conformance cases run);
* ``indices`` ``[s_q, h_kv, topk]`` ``torch.int32``; an entry ``-1`` or ``>= s_kv`` is
  invalid and skipped;
* ``d_v``: the value is the first ``d_v`` dims of each ``kv`` row (512 on the GPU; any
  ``d_v < d_qk`` here);
* returns ``(out [s_q, h_q, d_v]`` in ``q``'s dtype, ``max_logits [s_q, h_q]`` float32 (of the
  scaled logits), ``lse [s_q, h_q]`` float32 in base 2``); a query with no valid index gets
  zeros, ``-inf`` and ``-inf``.
"""

from __future__ import annotations

import math

import torch

from attnplug.backends.emulators.mla_kernels import MLAContractError

HEAD_MULTIPLE = 64


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise MLAContractError(f"flash_mla_sparse_fwd: {what}")


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                         d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Emulated ``flash_mla_sparse_fwd`` (see the module docstring).

    Raises:
        MLAContractError: an argument outside the documented contract (nothing computed).
    """
    _require(q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3, "q, kv and indices must be 3-D")
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, _ = kv.shape
    _require(h_q % HEAD_MULTIPLE == 0, f"h_q must be a multiple of {HEAD_MULTIPLE}, got {h_q} (pad the heads)")
    _require(h_kv == 1 and kv.shape[2] == d_qk, f"kv must be [s_kv, 1, {d_qk}], got {tuple(kv.shape)}")
    _require(q.dtype == kv.dtype and q.dtype in (torch.bfloat16, torch.float16, torch.float32),
             f"q and kv must share a float dtype (bfloat16 on the GPU), got {q.dtype} / {kv.dtype}")
    _require(indices.dtype == torch.int32 and tuple(indices.shape[:2]) == (s_q, h_kv),
             f"indices must be int32 [s_q, h_kv, topk] = [{s_q}, {h_kv}, topk], got {indices.dtype} "
             f"{tuple(indices.shape)}")
    _require(0 < d_v < d_qk, f"d_v must be in (0, d_qk), got {d_v}")
    idx = indices[:, 0].long()                                                    # [s_q, topk]
    valid = (idx >= 0) & (idx < s_kv)
    rows = kv[:, 0][torch.where(valid, idx, torch.zeros_like(idx))].float()      # [s_q, topk, d_qk]
    rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype))
    logits = torch.einsum("qhd,qkd->qhk", q.float(), rows) * sm_scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    max_logits = logits.max(-1).values
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.einsum("qhk,qkv->qhv", p.masked_fill(~valid.unsqueeze(1), 0.0), rows[..., :d_v])
    return out.to(q.dtype), max_logits, lse / math.log(2.0)
