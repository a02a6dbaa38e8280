"""The compiled ``Prepare`` kernel refuses a row whose scheduled positions leave its
block-table row (``IndexError`` naming the group and the position) on each of its slot
loops: token by token (a decode step), row by row with every row the same width (the
widths 2-5 are compiled as constants: a steady step with drafts) and row by row with mixed
widths. The step's validation excludes such a row; this pins the kernel's own guard, which
is the only thing between a bad row and a write past the table."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.runner.step.fast import NATIVE

pytestmark = pytest.mark.skipif(NATIVE is None, reason="the compiled kernels are not built")

M, W, T = 4, 64, 64  # rows, token-table width, token buffers
BLOCK, NCOLS = 4, 3  # block size, block-table columns: positions 0 .. 11 have a block


def _prepare(ncc: list[int], sched: list[int]):
    """A ``Prepare`` over ``len(ncc)`` rows of one paged group (block ``b`` of row ``r`` is
    ``10 r + b + 1``); returns ``(kernel, slot_mapping)``."""
    i32 = np.int32
    n = np.zeros(M, i32)
    n[:len(ncc)] = np.asarray(ncc) + np.asarray(sched)  # every scheduled token is real
    s = np.zeros(M, i32)
    s[:len(sched)] = sched
    c = np.zeros(M, i32)
    c[:len(ncc)] = ncc
    table = (np.arange(M)[:, None] * 10 + np.arange(NCOLS)[None, :] + 1).astype(i32)
    slots = np.zeros(T, np.int64)
    kernel = NATIVE.Prepare(
        s, c, n, n.copy(), np.ones((M, W), i32), np.zeros(M + 1, i32), np.zeros(T, np.int64),
        np.zeros(T, i32), np.zeros(M, i32), np.zeros(M, np.int64), np.zeros(T, np.int64),
        np.zeros(M, bool), np.zeros(M, bool), [table], [slots], [BLOCK])
    return kernel, slots


@pytest.mark.parametrize("ncc, sched, position", [
    ([3, 12, 5], [1, 1, 1], 12),          # a decode step: the per-token loop
    ([0, 9, 2], [3, 3, 3], 11),           # uniform width 3: fits (row 1 ends at 11)
    ([0, 10, 2], [3, 3, 3], 12),          # uniform width 3: row 1 ends at 12
    ([0, 4, 7], [5, 5, 5], 11),           # uniform width 5: fits
    ([0, 4, 8], [5, 5, 5], 12),           # uniform width 5: row 2 ends at 12
    ([0, 6, 1], [2, 6, 3], 11),           # mixed widths: fits
    ([0, 7, 1], [2, 6, 3], 12),           # mixed widths: row 1 ends at 12
])
def test_a_position_past_the_block_table_is_refused_on_every_slot_loop(ncc, sched, position):
    kernel, slots = _prepare(ncc, sched)
    R = len(ncc)
    if position < NCOLS * BLOCK:  # fits: the slots are the table's
        kernel.prepare(R, -1)
        pos = np.concatenate([np.arange(c, c + q) for c, q in zip(ncc, sched)])
        rows = np.repeat(np.arange(R), sched)
        expect = (rows * 10 + pos // BLOCK + 1) * BLOCK + pos % BLOCK
        np.testing.assert_array_equal(slots[:pos.shape[0]], expect)
        return
    with pytest.raises(IndexError, match=f"group 0: position {position} lies past the block table"):
        kernel.prepare(R, -1)
