"""Index arithmetic over ragged batches: one request's run of tokens after another.

The one shared home of the "cumsum and arange" helper (vLLM's
``_get_cumsum_and_arange``): every per-token index of a step (``query_start_loc``,
``req_indices``, positions within a request) is derived from per-request counts with
``cumsum``, ``repeat`` and one subtraction — never a Python loop over tokens. The block
tables use it for batched appends, the step compiler for the step's token stream.
"""

from __future__ import annotations

import numpy as np


def cumsum_and_arange(counts: np.ndarray,
                      arange_buffer: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive prefix sums of ``counts`` and, per entry, an arange of that length.

    Args:
        counts: ``[num_reqs]`` non-negative ints (e.g. tokens scheduled per request).
        arange_buffer: optional preallocated ``np.arange(n)`` with ``n >= counts.sum()``
            (``int64``); saves allocating a fresh arange each call.

    Returns:
        ``(cu_counts, aranges)``: ``cu_counts`` is ``[num_reqs]`` ``int64`` with
        ``cu_counts[i] = counts[0] + ... + counts[i]`` (prepend a 0 for the exclusive
        ``query_start_loc``); ``aranges`` is ``[counts.sum()]`` ``int64``, entry ``t`` the
        offset of element ``t`` within its own request's run.

    Examples:
        >>> cu, ar = cumsum_and_arange(np.array([2, 5, 3]))
        >>> cu.tolist(), ar.tolist()
        ([2, 7, 10], [0, 1, 0, 1, 2, 3, 4, 0, 1, 2])
    """
    counts = np.asarray(counts)
    cu = np.cumsum(counts, dtype=np.int64)
    total = int(cu[-1]) if cu.shape[0] else 0
    starts = np.repeat(cu - counts, counts)
    base = np.arange(total, dtype=np.int64) if arange_buffer is None else arange_buffer[:total]
    return cu, base - starts


def repeat_indices(counts: np.ndarray, arange_buffer: np.ndarray | None = None) -> np.ndarray:
    """``[counts.sum()]`` ``int64``: index ``i`` repeated ``counts[i]`` times (``req_indices``).

    Examples:
        >>> repeat_indices(np.array([2, 5, 3])).tolist()
        [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    """
    counts = np.asarray(counts)
    n = counts.shape[0]
    base = np.arange(n, dtype=np.int64) if arange_buffer is None else arange_buffer[:n]
    return np.repeat(base, counts)
