"""Linear layers on the CPU through oneDNN with the weight prepacked once.

``F.linear`` on the CPU calls MKL's ``sgemm`` with the weight as stored, every call; with
few rows (decode: one per request) it reaches a fraction of the core's peak (measured on
this project's machine, one thread, float32: SmolLM2's 49,152 x 576 LM head on 16 rows
56 ms with ``F.linear``, 15 ms prepacked; docs/performance.md, "Prepacked CPU linears").
vLLM's CPU build prepacks every linear weight for oneDNN at load for the same reason (a
fact about vLLM, not its code). Here torch's own oneDNN ops do it:
``torch.ops.mkldnn._reorder_linear_weight`` packs (what inductor's CPU freezing uses) and
``torch.ops.mkldnn._linear_pointwise`` multiplies, any number of rows.

The packed copy is a cache: it is rebuilt when the weight changes (its version counter,
bumped by every in-place write such as ``load_hf_state_dict``'s copy, or its storage, after
``.to()``), it costs a second copy of each packed weight's memory, and it is never saved,
pickled or deep-copied. Off the CPU, for dtypes other than float32 / bfloat16, while
``torch.compile`` traces, with autograd recording, for an inference tensor (made under
``torch.inference_mode``: it keeps no version counter, so a stale copy could not be told)
or with ``ATTNPLUG_CPU_PACKED_LINEAR=0`` the call is plain ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from attnplug.core import switches

PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes packed (oneDNN's CPU matmul: float32, and bfloat16 on AVX512-BF16/AMX)."""

ENABLED = (switches.flag("ATTNPLUG_CPU_PACKED_LINEAR") and torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
"""Whether CPU linears are prepacked: oneDNN present and ``ATTNPLUG_CPU_PACKED_LINEAR`` not ``0``."""

PACK_ROWS_HINT = 16
"""The row count oneDNN's weight layout is chosen for (any row count works)."""


class PackedWeights(dict):
    """``key -> (weight version, weight data_ptr, packed weight)``: a cache that pickles and
    deep-copies as empty (oneDNN tensors have no storage to save)."""

    def __reduce__(self):
        return (PackedWeights, ())

    def __deepcopy__(self, memo):
        return PackedWeights()


def packed(weight: torch.Tensor, cache: PackedWeights, key: str) -> torch.Tensor:
    """The oneDNN-packed copy of ``weight`` (``[out_features, in_features]``), from ``cache[key]``
    while ``weight`` is unchanged, else packed now and cached."""
    hit = cache.get(key)
    if hit is not None and hit[0] == weight._version and hit[1] == weight.data_ptr():
        return hit[2]
    w = weight.detach()
    out = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
    cache[key] = (weight._version, weight.data_ptr(), out)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: nn.Module,
           key: str = "weight") -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x`` ``[..., in_features]`` -> ``[..., out_features]``,
    ``x``'s dtype), on the CPU with ``weight`` prepacked (cached in ``owner``, under ``key``);
    see the module docstring for when it is plain ``F.linear``.

    The conditions are tested cheapest first (``is_cpu``, ``is`` on dtypes, the autograd
    flag before the tensors' ``requires_grad``): this runs four times per decoder layer and
    step, where the checks cost about as much as a 16-row product's call overhead."""
    dtype = weight.dtype
    if (not ENABLED or not x.is_cpu or x.dtype is not dtype or dtype not in PACKED_DTYPES
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            or weight.is_inference() or torch.compiler.is_compiling()):
        return _F_LINEAR(x, weight, bias)
    cache = owner.__dict__.get("packed_weights")
    if cache is None:
        cache = owner.__dict__["packed_weights"] = PackedWeights()
    return _LINEAR_POINTWISE(x, packed(weight, cache, key), bias, "none", _NO_SCALARS, "")


_F_LINEAR = nn.functional.linear
_LINEAR_POINTWISE = (torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise")
                     else None)
_NO_SCALARS: list = []  # the op's empty post-op scalars (read, never written)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) whose forward is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self)


__all__ = ["ENABLED", "Linear", "PACKED_DTYPES", "PackedWeights", "linear", "packed"]
