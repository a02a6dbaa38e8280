"""The compiled ``Prepare.prepare_patched`` plans the asynchronous patch as a from-scratch
reference does: the rows whose ``prev_sampled_index`` is set and whose placeholder is one
of this step's tokens, in token order, and ``contiguous`` exactly when the plan is
``arange(k)``. The usual decode step (every row sampled last step, in order, one token
each) takes a branch-free test instead of the row loop; these cases sit on both sides of
it: all rows in order, the last row without a token, one row whose placeholder is not its
first token, one row out of order, random layouts."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.runner.step.fast import NATIVE

pytestmark = pytest.mark.skipif(NATIVE is None, reason="the compiled kernels are not built")

M, W, T = 8, 32, 64  # rows, token-table width, token buffers


def _reference(pidx, ppos, ncc, sched):
    """``(dest, src)`` of the patch, row by row (``runner/step/placeholders.py``)."""
    qsl = np.concatenate([[0], np.cumsum(sched)])
    plan = [(qsl[r] + ppos[r] - ncc[r], pidx[r]) for r in range(len(sched))
            if pidx[r] >= 0 and 0 <= ppos[r] - ncc[r] < sched[r]]
    return [d for d, _ in plan], [s for _, s in plan]


def _plan(pidx, ppos, ncc, sched):
    """Run the kernel over ``len(sched)`` rows; returns ``(k, contiguous, dest, src,
    prev_sampled_index after)``."""
    R, i32 = len(sched), np.int32
    col = lambda v: np.concatenate([np.asarray(v, i32), np.zeros(M - R, i32)])  # noqa: E731
    s, c = col(sched), col(ncc)
    n = c + s
    prev_index = np.concatenate([np.asarray(pidx, i32), np.full(M - R, -1, i32)])
    dest, src = np.full(M, -7, np.int64), np.full(M, -7, np.int64)
    kernel = NATIVE.Prepare(
        s, c, n, n.copy(), np.ones((M, W), i32), np.zeros(M + 1, i32), np.zeros(T, np.int64),
        np.zeros(T, i32), np.zeros(M, i32), np.zeros(M, np.int64), np.zeros(T, np.int64),
        np.zeros(M, bool), np.zeros(M, bool), [None], [np.zeros(T, np.int64)], [4])
    kernel.bind_patch(prev_index, col(ppos), dest, src, np.zeros(2, np.int64))
    out = kernel.prepare_patched(R, -1, 0, 1000, -1)
    return out[3], out[4], dest, src, prev_index[:R]


@pytest.mark.parametrize("pidx, ppos, ncc, sched", [
    ([0, 1, 2, 3], [5, 9, 2, 7], [5, 9, 2, 7], [1, 1, 1, 1]),    # the usual step: arange(4)
    ([0, 1, 2, 3], [5, 9, 2, 7], [5, 9, 2, 7], [1, 1, 1, 4]),    # the last row a longer query
    ([0, 1, 2, 3], [5, 9, 2, 7], [5, 9, 2, 7], [1, 1, 1, 0]),    # the last row holds no token
    ([0, 1, 2, 3], [5, 9, 3, 7], [5, 9, 2, 7], [1, 1, 2, 1]),    # row 2's placeholder its 2nd token
    ([0, 1, 2, 3], [5, 10, 2, 7], [5, 9, 2, 7], [1, 1, 1, 1]),   # row 1's placeholder past its query
    ([0, 2, 1, 3], [5, 9, 2, 7], [5, 9, 2, 7], [1, 1, 1, 1]),    # rows 1 and 2 swapped: a scatter
    ([0, -1, 1, 2], [5, 9, 2, 7], [5, 9, 2, 7], [1, 1, 1, 1]),   # row 1 sampled nothing
    ([0, 1, 2, 3], [5, 9, 2, 7], [5, 9, 2, 7], [2, 1, 1, 1]),    # row 0 two tokens: shifted
    ([0], [3], [3], [1]),                                          # one row
])
def test_the_patch_plan_is_the_reference_one(pidx, ppos, ncc, sched):
    k, contiguous, dest, src, consumed = _plan(pidx, ppos, ncc, sched)
    ref_dest, ref_src = _reference(pidx, ppos, ncc, sched)
    assert k == len(ref_dest)
    assert contiguous == (ref_dest == ref_src == list(range(k)))
    if not contiguous:
        assert dest[:k].tolist() == ref_dest and src[:k].tolist() == ref_src
    assert (consumed == -1).all()  # every row's column consumed


def test_random_layouts_plan_as_the_reference():
    rng = np.random.default_rng(5)
    for _ in range(300):
        R = int(rng.integers(1, M + 1))
        sched = rng.integers(0, 4, R)
        ncc = rng.integers(0, 10, R)
        in_order = rng.random() < 0.5  # half near the usual step, half anything
        pidx = np.arange(R) if in_order else rng.permutation(R)
        pidx = np.where(rng.random(R) < (0.05 if in_order else 0.3), -1, pidx)
        ppos = ncc + (rng.integers(0, 2, R) * (rng.random(R) < 0.2) if in_order else rng.integers(-1, 4, R))
        k, contiguous, dest, src, _ = _plan(pidx, ppos, ncc, sched)
        ref_dest, ref_src = _reference(pidx, ppos, ncc, sched)
        assert k == len(ref_dest), (pidx, ppos, ncc, sched)
        assert contiguous == (ref_dest == ref_src == list(range(k))), (pidx, ppos, ncc, sched)
        if not contiguous:
            assert dest[:k].tolist() == ref_dest and src[:k].tolist() == ref_src
