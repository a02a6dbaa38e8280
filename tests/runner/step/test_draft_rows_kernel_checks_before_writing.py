"""The compiled ``DraftRows.write`` (stage 2 of a step with drafts) puts each row's drafts
after its tokens and sets its draft count, the same whether every row verifies the same
number (the counts 1-4 are compiled as constants) or not; and it checks every row before
writing anything: rows and counts of unequal length, or drafts past the token table, raise
``IndexError`` and leave the table and the counts as they were."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.runner.step.fast import NATIVE

pytestmark = pytest.mark.skipif(NATIVE is None, reason="the compiled kernels are not built")

M, W = 4, 8  # rows, token-table width


def _kernel():
    tokens = np.arange(M * W, dtype=np.int32).reshape(M, W)
    num_tokens = np.array([2, 5, 3, 1], np.int32)
    num_spec = np.array([9, 9, 9, 9], np.int32)  # the previous step's counts: all cleared
    return NATIVE.DraftRows(tokens, num_tokens, num_spec), tokens, num_tokens, num_spec


@pytest.mark.parametrize("rows, lens", [([0, 2, 3], [3, 3, 3]), ([1, 3], [2, 2]), ([2], [1]),
                                        ([0, 3], [4, 4]), ([3, 0, 1], [1, 3, 2]), ([1], [0])],
                         ids=["3 each", "2 each", "1", "4 each", "mixed", "none"])
def test_drafts_go_after_each_rows_tokens(rows, lens):
    kernel, tokens, num_tokens, num_spec = _kernel()
    expect = tokens.copy()
    flat = np.arange(100, 100 + sum(lens), dtype=np.int32)
    off = 0
    for r, n in zip(rows, lens):
        expect[r, num_tokens[r]:num_tokens[r] + n] = flat[off:off + n]
        off += n
    kernel.write(np.array(rows, np.int64), np.array(lens, np.int64), flat)
    np.testing.assert_array_equal(tokens, expect)
    counts = np.zeros(M, np.int32)
    counts[rows] = lens
    np.testing.assert_array_equal(num_spec, counts)


@pytest.mark.parametrize("rows, lens, flat_len, match", [
    ([0, 1], [3], 6, "differ in length"),
    ([0], [3, 3], 6, "differ in length"),
    ([0, 1], [3, 4], 7, "row 1's drafts leave the token table"),   # 5 tokens + 4 > 8
    ([0, 2], [3, 3], 5, "row 2's drafts leave the token table"),   # the ids run out
    ([0, 4], [1, 1], 2, "row 4 / 1 drafts"),
])
def test_bad_rows_are_refused_before_anything_is_written(rows, lens, flat_len, match):
    kernel, tokens, _, num_spec = _kernel()
    before = tokens.copy(), num_spec.copy()
    with pytest.raises(IndexError, match=match):
        kernel.write(np.array(rows, np.int64), np.array(lens, np.int64), np.full(flat_len, 7, np.int32))
    np.testing.assert_array_equal(tokens, before[0])
    np.testing.assert_array_equal(num_spec, before[1])
