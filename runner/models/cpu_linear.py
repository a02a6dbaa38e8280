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

float32 goes one step further: oneDNN's C API directly (``runner/models/onednn.py``, the
``onednn-cpu-gomp`` wheel's oneDNN 3.2 loaded at run time). torch's op reaches the same
brgemm kernel, but ideep builds descriptors, attributes and a primitive-cache key on every
call: the direct path is 9-29 µs a call faster at decode shapes, through this module's
checks (docs/performance.md, "Linears through oneDNN's C API (issue 38, session 15)"); :class:`~attnplug.runner.models._onednn.Matmul` keeps the
packed weight and its primitives (per row count and thread count) and only re-points them
at the call's tensors. The packed weight is a cache as above (same rules, same
``packed_weights`` dict, holding the ``Matmul`` under its own key, :func:`direct_key`, so a
weight whose calls alternate between the two paths keeps both). A call takes torch's op instead when the
direct path is unavailable or off (``ATTNPLUG_ONEDNN_DIRECT=0``; no wheel, no compiled
module), when ``x`` or the weight is not contiguous, the bias not a contiguous float32
``[out_features]``, or ``x`` has no rows; and ``F.linear`` when the weight's ``Matmul`` is
running in another thread (one call at a time each; the GIL is released during the product). A ``x`` whose last dimension is not
``in_features`` gets ``F.linear``'s error (``mat1 and mat2 shapes cannot be multiplied``).
Results: float32 accumulated in oneDNN's order, bitwise equal to torch's op on this
project's machine (tests/runner/models/test_direct_onednn_linear_equals_torch_op.py).
"""

from __future__ import annotations

import torch
from torch import nn

from attnplug.core import switches
from attnplug.runner.models import onednn

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
    if dtype is _F32 and (_DIRECT[0] if _DIRECT[0] is not _UNSET else _resolve()) is not None:
        k = weight.shape[-1]
        if x.dim() == 0 or x.shape[-1] != k:
            return _F_LINEAR(x, weight, bias)  # torch's shape error
        out = _direct(x, weight, bias, cache, key, k)
        if out is not None:
            return out
    return _LINEAR_POINTWISE(x, packed(weight, cache, key), bias, "none", _NO_SCALARS, "")


def direct(weight: torch.Tensor, cache: PackedWeights, key: str):
    """The :class:`~attnplug.runner.models._onednn.Matmul` holding ``weight`` (float32,
    contiguous ``[out_features, in_features]``) packed, from ``cache[direct_key(key)]`` while
    ``weight`` is unchanged, else packed now and cached (the rules of :func:`packed`). Its own
    entry, apart from :func:`packed`'s ``cache[key]``: a weight whose calls alternate between
    the two paths is packed once for each, not again at every switch.

    Raises:
        RuntimeError: the direct path is not loaded, or oneDNN refused the weight."""
    key = direct_key(key)
    hit = cache.get(key)
    if hit is not None and hit[0] == weight._version and hit[1] == weight.data_ptr():
        return hit[2]
    module = _DIRECT[0]
    if module is None or module is _UNSET:
        raise RuntimeError(f"the direct oneDNN path is not loaded: {onednn.load_error() or 'not tried'}")
    out_features, in_features = weight.shape
    mm = module.Matmul(weight.data_ptr(), out_features, in_features, PACK_ROWS_HINT)
    cache[key] = (weight._version, weight.data_ptr(), mm)
    return mm


def direct_key(key: str) -> str:
    """The cache key of :func:`direct`'s ``Matmul`` for the weight :func:`packed` caches under ``key``."""
    return key + ":direct"


def _direct(x, weight, bias, cache, key, k):
    """``linear`` through :func:`direct`'s ``Matmul``, or ``None`` where it does not take the
    call (the module docstring's list)."""
    rows = x.numel() // k if k else 0
    if (rows == 0 or not x.is_contiguous() or weight.dim() != 2 or not weight.is_contiguous()
            or (bias is not None and (bias.dtype is not _F32 or not bias.is_contiguous()
                                      or bias.shape != weight.shape[:1]))):
        return None
    mm = direct(weight, cache, key)
    out = torch.empty(x.shape[:-1] + weight.shape[:1], dtype=_F32)
    if mm.run(x.data_ptr(), rows, out.data_ptr(), 0 if bias is None else bias.data_ptr()):
        return out
    return _F_LINEAR(x, weight, bias)  # the Matmul is running in another thread


def use_direct(on: bool | None = None) -> bool:
    """Whether float32 linears take oneDNN's C API directly. ``None``: decide from
    :func:`attnplug.runner.models.onednn.matmul_module` (the switch, the wheel, the module),
    once per process unless called again; ``False``: torch's op (tests, benchmarks); ``True``:
    the direct path, raising ``RuntimeError`` when it cannot load."""
    if on is None or on:
        onednn.reset()
        _DIRECT[0] = onednn.matmul_module()
        if on and _DIRECT[0] is None:
            raise RuntimeError(f"the direct oneDNN path cannot load: {onednn.load_error()}")
    else:
        _DIRECT[0] = None
    return _DIRECT[0] is not None


_F_LINEAR = nn.functional.linear
_LINEAR_POINTWISE = (torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise")
                     else None)
_NO_SCALARS: list = []  # the op's empty post-op scalars (read, never written)
_F32 = torch.float32
_UNSET = object()
_DIRECT: list = [_UNSET]  # the loaded _onednn module, None (torch's op) or _UNSET (use_direct)


def _resolve():
    use_direct()
    return _DIRECT[0]


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) whose forward is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self)


__all__ = ["ENABLED", "Linear", "PACKED_DTYPES", "PackedWeights", "direct", "direct_key", "linear", "packed",
           "use_direct"]
