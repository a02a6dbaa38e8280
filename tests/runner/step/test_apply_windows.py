"""The sliding-window nulling of stage 2 on both kernels (``null_skipped_blocks``, the numpy
kernels' ``null_skipped``; the compiled ``BlockRows.null_skipped``) against a from-scratch
reference, without ATTNPLUG_VALIDATE.

Random batches, 1–2 sliding-window groups (all groups windowed, or mixed with a full
group), windows and block sizes down to 1, rows whose context grows by random amounts
over several calls: after each call exactly the blocks wholly before ``max(0, n - W + 1)``
are ``NULL_BLOCK_ID`` (manager and kernel tables), the others keep their ids, the returned
count is the number of entries newly nulled, and a second call writes nothing. A request
resumed from preemption starts with nothing nulled: its fresh blocks are nulled from block 0.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.step.apply_windows import null_skipped_blocks
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.kernels import CompiledKernels, kernels_available
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import SamplingParams

NULLERS = {"numpy": null_skipped_blocks}
if kernels_available():
    NULLERS["compiled"] = CompiledKernels(SamplingParams).null_skipped

MAX_LEN = 40


def skipped(n: int, window: int, block: int) -> int:
    return max(0, n - window + 1) // block


@pytest.mark.parametrize("kernel_name", list(NULLERS))
@settings(max_examples=120, deadline=None)
@given(data=st.data(), layout=st.sampled_from([
    ([1], [3], [1]), ([4], [6], [2]), ([2, 4], [3, 9], [1, 4]), ([4, 1], [None, 2], [2, 1]),
    ([3, 2], [5, None], [3, 2]), ([1, 1], [1, 4], [1, 1]), ([4, 2], [9, 3], [2, 1]),
]), rows=st.integers(1, 4))
def test_nulls_exactly_the_skipped_blocks(kernel_name, data, layout, rows):
    null = NULLERS[kernel_name]
    sizes, windows, kernel = layout
    batch = InputBatch(4, MAX_LEN, 64, sizes, kernel_block_sizes=kernel)
    ids = {}
    for r in range(rows):
        blocks = tuple(np.arange(1, -(-MAX_LEN // B) + 1, dtype=np.int32) + 100 * r for B in sizes)
        ids[r] = blocks
        batch.add_request(CachedRequestState(f"r{r}", [1] * MAX_LEN, blocks))
    n = np.zeros(rows, dtype=np.int64)
    for _ in range(4):
        n = np.minimum(n + np.array(data.draw(st.lists(st.integers(0, 12), min_size=rows, max_size=rows))),
                       MAX_LEN - 1)
        before = [bt.block_table_np.copy() for bt in batch.block_table]
        batch.num_computed_tokens_cpu[:rows] = n
        written = null(batch, windows)
        expect_written = 0
        for g, (bt, W, B, k) in enumerate(zip(batch.block_table, windows, sizes, kernel)):
            for r in range(rows):
                want = ids[r][g].copy()
                if W is not None:
                    s = skipped(int(n[r]), W, B)
                    want[:s] = NULL_BLOCK_ID
                    expect_written += int((before[g][r, :s] != NULL_BLOCK_ID).sum())
                assert bt.block_table_np[r, :want.shape[0]].tolist() == want.tolist(), (g, r, int(n[r]))
                per = B // k
                kernel_want = np.repeat(want.astype(np.int64) * per, per) + np.tile(np.arange(per), want.shape[0])
                kernel_want[np.repeat(want, per) == NULL_BLOCK_ID] = NULL_BLOCK_ID
                got = bt.kernel_block_table.np[r, :kernel_want.shape[0]]
                assert got.tolist() == kernel_want.tolist(), (g, r, "kernel")
        assert written == expect_written
        assert (batch.num_computed_tokens_nulled[:rows] == n).all()
        assert null(batch, windows) == 0  # idempotent within the step


@pytest.mark.parametrize("kernel_name", list(NULLERS))
def test_no_window_and_no_rows_write_nothing(kernel_name):
    null = NULLERS[kernel_name]
    batch = InputBatch(2, 16, 16, [4])
    assert null(batch, [8]) == 0  # no rows
    batch.add_request(CachedRequestState("a", [1] * 16, (np.array([1, 2, 3, 4], np.int32),)))
    batch.num_computed_tokens_cpu[0] = 15
    assert null(batch, [None]) == 0
    assert batch.block_table[0].block_table_np[0, :4].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("kernel_name", list(NULLERS))
def test_skipped_blocks_past_the_table_are_refused(kernel_name):
    """A context whose skipped blocks would leave the row's table (the step's checks exclude
    it) raises ``IndexError``; the compiled kernel checks every row before writing."""
    batch = InputBatch(2, 16, 16, [4])
    batch.add_request(CachedRequestState("a", [1] * 16, (np.array([1, 2, 3, 4], np.int32),)))
    batch.add_request(CachedRequestState("b", [1] * 16, (np.array([5, 6, 7, 8], np.int32),)))
    batch.num_computed_tokens_cpu[:2] = [8, 40]  # b: 40 tokens past a window of 1 skip 10 blocks of 4
    with pytest.raises(IndexError):
        NULLERS[kernel_name](batch, [1])
    if kernel_name == "compiled":
        assert batch.block_table[0].block_table_np[:2, :4].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
        assert batch.num_computed_tokens_nulled[:2].tolist() == [0, 0]


@pytest.mark.parametrize("kernel_name", list(NULLERS))
def test_rows_past_num_reqs_are_neither_read_nor_written(kernel_name):
    """Only rows ``0 .. num_reqs - 1`` count: a free row whose columns and table still hold a
    long context (stale values) is left as it is, and nothing of it is counted."""
    null = NULLERS[kernel_name]
    batch = InputBatch(4, MAX_LEN, 64, [2], kernel_block_sizes=[2])
    batch.add_request(CachedRequestState("r0", [1] * MAX_LEN, (np.arange(1, 21, dtype=np.int32),)))
    bt = batch.block_table[0]
    stale = np.arange(101, 121, dtype=np.int32)
    bt.block_table_np[2, :20] = stale  # row 2 is free (num_reqs is 1)
    batch.num_computed_tokens_cpu[:3] = [5, 0, 30]
    batch.num_computed_tokens_nulled[:3] = 0
    assert null(batch, [4]) == skipped(5, 4, 2)
    assert bt.block_table_np[2, :20].tolist() == stale.tolist()
    assert batch.num_computed_tokens_nulled[2] == 0


@pytest.mark.parametrize("native", [False] + ([True] if kernels_available() else []))
def test_a_resumed_rows_fresh_blocks_are_nulled_from_block_0(native):
    """A request resumed from preemption gets fresh blocks, none nulled yet: with a window
    of 1 token in blocks of 1 (the only layout where one computed token skips a block) the
    step nulls every block before its context, block 0 included, on either kernel."""
    from attnplug.runner.step.compiler import StepCompiler
    from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    sc = StepCompiler([1], 2, 16, 16, num_blocks=32, group_kinds=["sliding_window"], sliding_windows=[1],
                      native=native, validate=True)
    first = SchedulerOutput([NewRequestData("r", [1, 2, 3, 4], ([1, 2, 3, 4],)), NewRequestData("s", [5, 6], ([9, 10],))],
                            CachedRequestData(), {"r": 4, "s": 2})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens(["r", "s"], [7, 8])
    only_s = SchedulerOutput([], CachedRequestData(["s"], [False], [[]], [([11],)], [2]), {"s": 1})  # r preempted
    sc.update_states(only_s)
    sc.prepare_inputs(only_s)
    resumed = SchedulerOutput([], CachedRequestData(["r"], [True], [[]], [([5, 6, 12, 13, 14],)], [3]), {"r": 2})
    sc.update_states(resumed)
    b = sc.input_batch
    r = b.req_id_to_index["r"]
    assert b.block_table[0].block_table_np[r, :6].tolist() == [NULL_BLOCK_ID] * 3 + [13, 14, 0]
    assert b.num_computed_tokens_nulled[r] == 3
    assert sc.prepare_inputs(resumed).slot_mapping[0].tolist() == [13, 14]
