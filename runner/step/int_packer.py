"""``IntPacker``: many Python int lists → ``int32`` numpy views, fast, range-checked.

All sequences of one call land back to back in one reusable buffer; the packing loop is
the kernels' ``pack_ints`` (``runner/step/step_kernels.py``: ``struct.pack_into`` at ~10 ns per
int on the numpy kernels, one compiled pass at ~2 ns per int on the compiled ones, which
hands numpy arrays and bad values to the numpy loop so that one place words the fault).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from attnplug.runner.step.step_kernels import StepKernels


class IntPacker:
    """Packs int sequences into one reusable ``int32`` buffer.

    Returned views are valid until the next :meth:`pack` call on the same packer.

    Args:
        kernels: the step's kernels (their ``pack_ints`` loop).
        capacity: initial buffer size (ints); the buffer grows as needed.
    """

    def __init__(self, kernels: StepKernels, capacity: int = 1 << 16):
        self.kernels = kernels
        self._buf = np.empty(capacity, dtype=np.int32)
        self.flat = self._buf[:0]
        """``[total]`` ``int32``: all values of the latest ``pack`` call, back to back."""
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
        packed, lo, hi = self.kernels.pack_ints(seqs if type(seqs) is list else list(seqs), buf)
        if packed < 0:
            return -packed - 1
        self.flat = buf[:total]
        self.min, self.max = lo, hi
        views, off = [], 0
        for n in lens:
            views.append(buf[off:off + n])
            off += n
        return views
