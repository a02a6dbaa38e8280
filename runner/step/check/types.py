"""Stage 1, the typing rule: what counts as an int, an int list, a flag; the one error.

Every check of stage 1 raises through :func:`err` and judges values with these
predicates, on both paths, so one rule holds everywhere (written out in
``runner/step/scheduler_output.py``).
"""

from __future__ import annotations

import struct
from typing import Any, NoReturn

import numpy as np
import torch

from attnplug.core.errors import InvalidSchedulerOutput, MetadataError

SEQUENCES = (list, tuple)
ID_SETS = (set, frozenset, list, tuple)
FLAGS = (bool, np.bool_)


def err(req_id: Any, field_name: str, message: str) -> NoReturn:
    """Raise :class:`InvalidSchedulerOutput` (stage 1 has changed nothing at this point)."""
    raise InvalidSchedulerOutput(req_id, field_name, message)


MAX_ECHO = 200
"""Characters of a caller's value echoed into an error message at most."""


def show(value: Any) -> str:
    """``repr(value)``, cut to :data:`MAX_ECHO` characters (an id may be huge)."""
    try:
        text = repr(value)
    except Exception as e:  # a repr that raises
        text = f"<{type(value).__name__} whose repr raised {type(e).__name__}>"
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + f"... ({len(text)} characters)"


def request_id(rid: Any, field_name: str) -> str:
    """The typing rule of request ids, on every path (new and cached requests, the keys of
    ``num_scheduled_tokens`` and ``scheduled_spec_decode_tokens``, ``finished_req_ids``,
    stage 8's ids): a ``str``, or a ``str`` subclass such as ``numpy.str_`` (an id taken from
    a numpy array), which is looked up by its value (a subclass must keep ``str``'s hash and
    equality, as ``numpy.str_`` does). An id the runner keeps (a new request's) is this
    plain ``str``: ``str.__str__`` of a subclass is an exact ``str`` copy.

    Raises:
        InvalidSchedulerOutput: anything else (``bytes``, an int, ``None``), naming ``field_name``.
    """
    if type(rid) is str:
        return rid
    if not isinstance(rid, str):
        err(None, field_name, f"request ids must be str, got {type(rid).__name__} {show(rid)}")
    return str.__str__(rid)


def is_int(x: Any) -> bool:
    """``x`` is an ``int`` or numpy integer scalar, not a ``bool``."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


_BOOL_DTYPES = (np.dtype(bool), torch.bool)


def is_bool_like(x: Any) -> bool:
    """``x`` is a bool of any kind that ``struct`` (``operator.index``) would take as 0 or 1:
    a ``bool``, or a one-element bool tensor or array (``numpy.bool_`` has no ``__index__``)."""
    return isinstance(x, bool) or getattr(x, "dtype", None) in _BOOL_DTYPES


def is_flag(x: Any) -> bool:
    """``x`` is a ``bool`` or ``numpy.bool_``."""
    return isinstance(x, FLAGS)


def is_int_list(x: Any) -> bool:
    """``x`` is a list/tuple (contents checked where it is packed) or a 1-D integer array."""
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and x.dtype.kind in "iu"
    return isinstance(x, SEQUENCES)


def int64_list(values) -> np.ndarray | None:
    """A list/tuple of ints (``int`` or numpy integer scalars, not a bool of any kind:
    :func:`is_bool_like`) as ``[n]`` ``int64``, or ``None`` when an entry is anything else or
    does not fit ``int64``."""
    n = len(values)
    out = np.empty(n, dtype=np.int64)
    try:  # struct takes exactly the ints (and bools: checked below); floats and strings raise
        if n:
            struct.pack_into(f"{n}q", out, 0, *values)
    except (struct.error, TypeError, ValueError, OverflowError):
        return None
    if n:
        types = set(map(type, values))
        if bool in types:
            return None
        if types != _INT_ONLY and any(is_bool_like(v) for v in values if type(v) is not int):
            return None  # (a one-element bool tensor: struct took it as 0 or 1)
    return out


_INT_ONLY = {int}


def row_indices(rows: Any, who: str) -> np.ndarray:
    """Batch rows given to a stage-8 call (``append_output_tokens``, ``append_verified_tokens``,
    ``append_placeholders``) as ``[n]`` ``int64``: a list or tuple of ints (``int`` or numpy
    integer scalars, never ``bool``), or a 1-D integer numpy array (an empty one of any
    dtype: no rows). The range is the caller's to check.

    Raises:
        MetadataError: anything else: a row that is not an int (a float such as ``1.0``, a
            bool, a string), which numpy would otherwise truncate or parse; a 2-D array or a
            list of lists (numpy would flatten it into rows); a scalar, a tensor, a set.
    """
    if isinstance(rows, np.ndarray):
        if rows.ndim == 1 and (rows.dtype.kind in "iu" or rows.shape[0] == 0):
            return rows.astype(np.int64, copy=False)
    elif isinstance(rows, SEQUENCES):
        arr = int64_list(rows)
        if arr is not None:
            return arr
    raise MetadataError(f"{who}: rows must be ints, as a list or a 1-D integer array, got {show(rows)}")


def rows_distinct(rows: np.ndarray, bound: int) -> bool:
    """Whether ``rows`` (``[n]`` integer, each already checked in ``[0, bound)``) holds no
    row twice: a mask over ``[0, bound)``, no sort (stage 8's calls)."""
    seen = np.zeros(bound, dtype=bool)
    seen[rows] = True
    return int(np.count_nonzero(seen)) == rows.shape[0]
