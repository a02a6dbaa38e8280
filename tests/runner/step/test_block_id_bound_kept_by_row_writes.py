"""``BlockTable.block_id_bound`` (per row, an upper bound of the ids it holds) is kept by
every write, so that stage 1's compiled scan may skip reading a row whose appended ids all
exceed it: an appended id the row already holds is still refused after the row moved, was
swapped, cleared and refilled; the bound covers every row after each table operation."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.cache_groups.block_table import MultiGroupBlockTable
from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

PATHS = [False] + ([True] if NATIVE is not None else [])


def assert_bound_covers_rows(table: MultiGroupBlockTable) -> None:
    """Every row's bound is at least the largest id it holds (0 for an empty row is allowed)."""
    for g, bt in enumerate(table):
        for r in range(bt.max_num_reqs):
            n = int(bt.num_blocks_per_row[r])
            if n:
                top = int(bt.block_table_np[r, :n].max())
                assert int(bt.block_id_bound[r]) >= top, (g, r, int(bt.block_id_bound[r]), top)


@pytest.mark.parametrize("native", PATHS)
def test_an_id_the_row_holds_is_refused_after_the_row_moved(native):
    sc = StepCompiler([4], 2, 32, 16, native=native, validate=True)
    sc.update_states(SchedulerOutput([NewRequestData("a", list(range(8)), ([1, 2],)),
                                      NewRequestData("b", list(range(8)), ([5, 6],))], CachedRequestData(),
                                     {"a": 8, "b": 8}))
    sc.prepare_inputs()
    sc.append_output_tokens(["a", "b"], [1, 1])
    # "a" finishes: "b" (row 1) moves into row 0, holding [5, 6, 7]
    sc.update_states(SchedulerOutput([], CachedRequestData(["b"], [False], [[]], [([7],)], [8]), {"b": 1},
                                     finished_req_ids={"a"}))
    sc.prepare_inputs()
    assert sc.input_batch.req_ids == ["b"]
    assert sc.input_batch.block_table[0].block_table_np[0, :3].tolist() == [5, 6, 7]
    assert_bound_covers_rows(sc.input_batch.block_table)
    sc.append_output_tokens(["b"], [1])
    before = sc.snapshot()
    so = SchedulerOutput([], CachedRequestData(["b"], [False], [[]], [([6],)], [9]), {"b": 1})
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(so)
    assert (info.value.req_id, info.value.field) == ("b", "new_block_ids")
    assert "block id 6 appears twice" in str(info.value)
    assert not snapshot_diff(before, sc.snapshot())
    # an id above everything the row holds is taken (the bound's fast case)
    sc.update_states(SchedulerOutput([], CachedRequestData(["b"], [False], [[]], [([9],)], [9]), {"b": 1}))
    assert sc.input_batch.block_table[0].block_table_np[0, :4].tolist() == [5, 6, 7, 9]
    assert_bound_covers_rows(sc.input_batch.block_table)


@pytest.mark.parametrize("native", PATHS)
def test_an_id_a_refilled_row_holds_is_refused(native):
    """Row 0 held large ids, was cleared and refilled with small ones: its bound is the new
    row's, and an id the new row holds is refused."""
    sc = StepCompiler([4], 2, 32, 16, native=native, validate=True)
    sc.update_states(SchedulerOutput([NewRequestData("a", list(range(8)), ([20, 21],))], CachedRequestData(),
                                     {"a": 8}))
    sc.prepare_inputs()
    sc.update_states(SchedulerOutput([NewRequestData("c", list(range(8)), ([2, 3],))], CachedRequestData(),
                                     {"c": 8}, finished_req_ids={"a"}))
    sc.prepare_inputs()
    assert int(sc.input_batch.block_table[0].block_id_bound[0]) == 3
    sc.append_output_tokens(["c"], [1])
    so = SchedulerOutput([], CachedRequestData(["c"], [False], [[]], [([2],)], [8]), {"c": 1})
    with pytest.raises(InvalidSchedulerOutput, match="block id 2 appears twice"):
        sc.update_states(so)


def test_every_table_operation_keeps_the_bound():
    t = MultiGroupBlockTable([4, 8], 4, 64, 32, kernel_block_sizes=[2, 8])
    t.add_row([[3, 9], [4]], 0)
    t.add_row([[12], [2, 30]], 1)
    assert_bound_covers_rows(t)
    t.append_row([[40], [1]], 0)
    assert [int(bt.block_id_bound[0]) for bt in t] == [40, 4]
    t[0].append_rows(np.array([1, 2]), np.array([2, 1]), np.array([50, 7, 8]))
    t[1].write_blocks(np.array([2, 2]), np.array([0, 1]), np.array([60, 5], dtype=np.int32))
    t[1].num_blocks_per_row[2] = 2
    assert_bound_covers_rows(t)
    assert [int(bt.block_id_bound[2]) for bt in t] == [8, 60]
    t[0].move_rows(np.array([1]), np.array([3]))
    t[1].move_rows(np.array([1]), np.array([3]))
    assert_bound_covers_rows(t)
    assert int(t[0].block_id_bound[3]) == 50
    for bt in t:
        bt.swap_row(0, 2)
    assert_bound_covers_rows(t)
    assert [int(bt.block_id_bound[0]) for bt in t] == [8, 60]
    t.clear_row(0)
    assert [int(bt.block_id_bound[0]) for bt in t] == [0, 0]
    t[0].fill_vacant_row(np.array([11, 6], dtype=np.int32), 0)
    assert int(t[0].block_id_bound[0]) == 11
    assert_bound_covers_rows(t)
