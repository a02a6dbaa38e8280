"""``IntPacker``: many Python int lists → ``int32`` numpy views, fast, range-checked.

``struct.pack_into`` converts a list of Python ints at ~10 ns per int, about twice as
fast as ``np.array(list)``, and rejects non-ints and values outside ``[0, 2**32)`` on
its own. All sequences of one call land back to back in one reusable buffer, so one
reduction checks the whole batch for values ``>= 2**31`` (they read back negative).

With the compiled fast path (``runner.step.fast``) one call packs and range-checks lists
and tuples at ~2 ns per int; anything else it declines (numpy arrays, or a bad value)
takes the ``struct`` loop, which also words which sequence is at fault.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from attnplug.runner.step.fast import NATIVE

INT32_MAX = 2**31 - 1


class IntPacker:
    """Packs int sequences into one reusable ``int32`` buffer.

    Returned views are valid until the next :meth:`pack` call on the same packer.

    Args:
        capacity: initial buffer size (ints); the buffer grows as needed.
    """

    def __init__(self, capacity: int = 1 << 16, native: bool = True):
        self._native = NATIVE if native else None
        self._buf = np.empty(capacity, dtype=np.int32)
        self.flat = self._buf[:0]
        """All values of the latest ``pack`` call, back to back."""
        self.min = 0
        """Smallest value of the latest ``pack`` call (0 when empty)."""
        self.max = 0
        """Largest value of the latest ``pack`` call (0 when empty)."""

    def pack(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray] | int:
        """Pack ``seqs`` (lists or tuples of ints, or 1-D integer arrays).

        An int is an ``int`` or a numpy integer scalar, never a ``bool`` (nor a float or a
        string); an array must be 1-D with an integer dtype.

        Returns:
            One ``int32`` view per sequence, or the index of the first sequence that is not
            one of those or holds something that is not an int in ``[0, 2**31)``.
        """
        lens = []
        for i, s in enumerate(seqs):
            if isinstance(s, np.ndarray) and s.ndim != 1:  # a 0-d array has no len()
                return i
            lens.append(len(s))
        total = sum(lens)
        if total > self._buf.shape[0]:
            self._buf = np.empty(max(total, 2 * self._buf.shape[0]), dtype=np.int32)
        buf = self._buf
        if self._native is not None:
            packed, lo, hi = self._native.pack_int32(seqs if type(seqs) is list else list(seqs), buf)
            if packed == total:  # else: arrays, or a bad value (the loop below finds which)
                self.flat = buf[:total]
                self.min, self.max = lo, hi
                views, off = [], 0
                for n in lens:
                    views.append(buf[off:off + n])
                    off += n
                return views
        mv = memoryview(buf).cast("B")
        off = 0
        for i, s in enumerate(seqs):
            n = lens[i]
            try:
                if isinstance(s, np.ndarray):
                    if s.ndim != 1 or s.dtype.kind not in "iu":
                        return i
                    # values that fit int32 need no check here: negatives show in the final min
                    if n and (s.dtype.itemsize > 4 or s.dtype == np.uint32) and (
                            s.max() > INT32_MAX or (s.dtype.kind == "i" and s.min() < 0)):
                        return i
                    buf[off:off + n] = s
                elif n:
                    struct.pack_into(f"{n}I", mv, off * 4, *s)
            except (struct.error, TypeError, ValueError, OverflowError):
                return i
            off += n
        self.flat = flat = buf[:total]
        self.min = int(flat.min()) if total else 0
        self.max = int(flat.max()) if total else 0
        if total and self.min <= 1:  # a bool packs as 0 or 1: look at those entries only
            bad = _first_bool(seqs, lens, flat)
            if bad is not None:
                return bad
        views, off = [], 0
        for i, n in enumerate(lens):
            v = buf[off:off + n]
            if self.min < 0 and n and v.min() < 0:  # a value in [2**31, 2**32) read back negative
                return i
            views.append(v)
            off += n
        return views


def _first_bool(seqs: Sequence[Sequence[int]], lens: list[int], flat: np.ndarray) -> int | None:
    """The first sequence (of lists/tuples packed into ``flat``) holding a ``bool``
    (``struct`` takes ``True`` as 1): only entries that packed as 0 or 1 are looked at."""
    where = np.flatnonzero(flat <= 1)
    if where.shape[0] == 0:
        return None
    ends = np.cumsum(lens)
    owners = np.searchsorted(ends, where, side="right")
    starts = ends - np.asarray(lens, dtype=ends.dtype)
    for t, i in zip(where.tolist(), owners.tolist()):
        s = seqs[i]
        if not isinstance(s, np.ndarray) and type(s[t - int(starts[i])]) is bool:
            return i
    return None
