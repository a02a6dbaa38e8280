"""Snapshots and comparisons of metadata objects, for the mutation and reuse checks.

Works on any object a builder returns: dataclasses, tuples/lists/dicts of them, tensors,
numpy arrays and scalars are compared by value (tensors bit-exactly); anything else
(kernel wrapper objects, plans) by identity only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)
_MAX_DEPTH = 4


def _clone(value: Any, depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().clone(), value.data_ptr())
    if isinstance(value, np.ndarray):
        return ("ndarray", value.copy(), None)
    if isinstance(value, _SCALARS):
        return ("scalar", value, None)
    if depth >= _MAX_DEPTH:
        return ("object", id(value), None)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ("dataclass", {f.name: (id(getattr(value, f.name)), _clone(getattr(value, f.name), depth + 1))
                              for f in dataclasses.fields(value)}, None)
    if isinstance(value, (tuple, list)):
        return ("seq", [_clone(v, depth + 1) for v in value], len(value))
    if isinstance(value, dict):
        return ("dict", {k: _clone(v, depth + 1) for k, v in value.items()}, None)
    return ("object", id(value), None)


def snapshot(obj: Any) -> Any:
    """A deep, comparable copy of ``obj`` (see the module docstring)."""
    return _clone(obj, 0)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(torch.equal(a.view(torch.uint8) if a.is_contiguous() else a.contiguous().view(torch.uint8),
                                b.view(torch.uint8) if b.is_contiguous() else b.contiguous().view(torch.uint8)))
    return bool(torch.equal(a, b))


def changes_since(obj: Any, snap: Any, path: str = "") -> list[str]:
    """Every difference between ``obj`` now and its ``snap``; each item names the field path.

    In-place writes to tensors and reassigned dataclass fields are both reported.
    """
    kind, data, extra = snap
    name = path or "<object>"
    if kind == "tensor":
        if not isinstance(obj, torch.Tensor):
            return [f"{name}: was a tensor, now {type(obj).__name__}"]
        if not _same_tensor(obj.detach().cpu(), data.cpu()):
            return [f"{name}: tensor contents/shape/dtype changed in place"]
        return []
    if kind == "ndarray":
        return [] if isinstance(obj, np.ndarray) and np.array_equal(obj, data) else [f"{name}: array changed"]
    if kind == "scalar":
        return [] if type(obj) is type(data) and obj == data else [f"{name}: {data!r} -> {obj!r}"]
    if kind == "object":
        return [] if id(obj) == data else [f"{name}: object replaced"]
    if kind == "dataclass":
        out = []
        for field_name, (ident, sub) in data.items():
            value = getattr(obj, field_name)
            sub_path = f"{path}.{field_name}" if path else field_name
            if id(value) != ident and not isinstance(value, _SCALARS):
                out.append(f"{sub_path}: field reassigned to a new object")
                continue
            out += changes_since(value, sub, sub_path)
        return out
    if kind == "seq":
        if not isinstance(obj, (tuple, list)) or len(obj) != extra:
            return [f"{name}: sequence replaced or resized"]
        return [d for i, (v, s) in enumerate(zip(obj, data)) for d in changes_since(v, s, f"{path}[{i}]")]
    if kind == "dict":
        if not isinstance(obj, dict) or set(obj) != set(data):
            return [f"{name}: dict keys changed"]
        return [d for k in data for d in changes_since(obj[k], data[k], f"{path}[{k!r}]")]
    raise AssertionError(f"unknown snapshot kind {kind!r}")  # internal invariant


def value_differences(a: Any, b: Any, path: str = "", depth: int = 0) -> list[str]:
    """Field-by-field value differences between two metadata objects (e.g. an
    ``update_block_table`` result and a fresh ``build``). Tensors must be bit-identical;
    opaque objects are not compared."""
    name = path or "<object>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{name}: tensor vs {type(b).__name__}"]
        if not _same_tensor(a.detach().cpu(), b.detach().cpu()):
            return [f"{name}: tensors differ (shapes {tuple(a.shape)} vs {tuple(b.shape)})"]
        return []
    if isinstance(a, np.ndarray):
        return [] if isinstance(b, np.ndarray) and np.array_equal(a, b) else [f"{name}: arrays differ"]
    if isinstance(a, _SCALARS):
        return [] if a == b else [f"{name}: {a!r} vs {b!r}"]
    if depth >= _MAX_DEPTH or type(a) is not type(b):
        return [] if type(a) is type(b) else [f"{name}: {type(a).__name__} vs {type(b).__name__}"]
    if dataclasses.is_dataclass(a):
        return [d for f in dataclasses.fields(a)
                for d in value_differences(getattr(a, f.name), getattr(b, f.name),
                                           f"{path}.{f.name}" if path else f.name, depth + 1)]
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return [f"{name}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in value_differences(x, y, f"{path}[{i}]", depth + 1)]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{name}: keys differ"]
        return [d for k in a for d in value_differences(a[k], b[k], f"{path}[{k!r}]", depth + 1)]
    return []


def rows_written_outside(before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor) -> list[int]:
    """The rows, not in ``slots``, whose contents differ between two copies of a cache.

    Args:
        before, after: ``[num_rows, row_width]`` views of the cache before and after a step.
        slots: int64 ``[num_tokens]``, the rows the step may write (its ``slot_mapping``).

    Returns:
        Row indices of ``before`` (ascending) outside ``slots`` where any element changed; NaN
        poison that stays NaN counts as unchanged.
    """
    others = torch.ones(before.shape[0], dtype=torch.bool)
    others[slots] = False
    b, a = before[others], after[others]
    changed = (~((b == a) | (torch.isnan(b) & torch.isnan(a)))).any(1).nonzero().flatten()
    return others.nonzero().flatten()[changed].tolist()
