"""Stage 8 with a step in flight (``runner/step/placeholders.py``), module by module:
``append_placeholders`` points exactly the sampling rows at their entries and refuses
rows that sample nothing (``max_model_len`` included); ``plan_patch`` finds the
placeholders after the rows moved and consumes the columns; ``patch_input_ids`` writes
the device tokens by slice or by scatter; ``fill_output_tokens`` writes them over the
placeholders wherever the requests are now (no ``ATTNPLUG_VALIDATE`` needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import MetadataError
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.placeholders import PLACEHOLDER_TOKEN_ID, PatchPlan, Placeholders, patch_input_ids
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


@pytest.fixture(params=[False] + ([True] if kernels_available() else []), ids=lambda n: "compiled" if n else "numpy")
def native(request) -> bool:
    """Each test on both kernels: stage 8's compiled pass (``SampledRows``) must check,
    write and decline exactly where the numpy code does."""
    return request.param


def compiler(native: bool, max_model_len: int = 16) -> StepCompiler:
    """A (3 tokens), B (5) and C (2 of 4 computed: still prefilling) after one step."""
    sc = StepCompiler([4], max_num_reqs=4, max_model_len=max_model_len, max_num_batched_tokens=16,
                      num_blocks=32, native=native)
    so = SchedulerOutput([NewRequestData("A", [1, 2, 3], ([1],)), NewRequestData("B", [4, 5, 6, 7, 8], ([2, 3],)),
                          NewRequestData("C", [9, 9, 9, 9], ([4],))], CachedRequestData(), {"A": 3, "B": 5, "C": 2})
    sc.update_states(so)
    sc.prepare_inputs(so)
    return sc


def test_each_sampling_row_points_at_its_entry_and_the_others_at_none(native):
    sc = compiler(native)
    b = sc.input_batch
    rA, rB, rC = (b.req_id_to_index[r] for r in "ABC")
    b.prev_sampled_index[rC] = 5  # stale: from an older step
    ph = sc.append_placeholders(np.array([rB, rA]))  # the sampled tensor's order: B, then A
    assert ph.req_ids == ("B", "A") and ph.positions.tolist() == [5, 3]
    assert b.prev_sampled_index[[rB, rA, rC]].tolist() == [0, 1, -1]
    assert b.prev_sampled_pos[[rB, rA]].tolist() == [5, 3]
    assert b.num_tokens[[rA, rB, rC]].tolist() == [4, 6, 4]
    assert b.token_ids_cpu[rA, 3] == b.token_ids_cpu[rB, 5] == PLACEHOLDER_TOKEN_ID
    assert b.token_ids_cpu[rC, :4].tolist() == [9, 9, 9, 9]  # untouched


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_the_placeholders_name_each_request_of_every_row_in_the_given_order(order, native):
    sc = StepCompiler([4], max_num_reqs=4, max_model_len=16, max_num_batched_tokens=16, num_blocks=32,
                      native=native)
    so = SchedulerOutput([NewRequestData("A", [1, 2, 3], ([1],)), NewRequestData("B", [4, 5], ([2],))],
                         CachedRequestData(), {"A": 3, "B": 2})
    sc.update_states(so)
    sc.prepare_inputs(so)
    b = sc.input_batch
    names = [b.req_ids[r] for r in order]
    ph = sc.append_placeholders(np.array(order))  # every row samples: in order, or not
    assert ph.req_ids == tuple(names) and ph.positions.tolist() == [3 if n == "A" else 2 for n in names]
    assert ph.rows.tolist() == order


def test_a_row_without_a_request_is_refused_and_changes_nothing(native):
    sc = compiler(native)
    b = sc.input_batch
    b.remove_request("A")  # a hole at A's row until condense (update_states condenses)
    hole = next(r for r in range(3) if b.state_at(r) is None)
    rows = sorted({hole, b.req_id_to_index["B"]})
    before = sc.snapshot()
    with pytest.raises(MetadataError, match=f"append_placeholders: row {hole} holds no request"):
        sc.append_placeholders(np.array(rows))
    assert not snapshot_diff(before, sc.snapshot())


@pytest.mark.parametrize("rows, words", [
    ([2], "request 'C' samples no token this step (seq_len 2, num_tokens 4, max_model_len 16)"),
    ([0, 1, 2], "request 'C' samples no token this step (seq_len 2, num_tokens 4"),  # the row that fails is named
    ([0, 0], "rows must be distinct and in [0, 3), got [0, 0]"),
    ([3], "rows must be distinct and in [0, 3), got [3]"),
    ([-1], "rows must be distinct and in [0, 3), got [-1]"),
])
def test_rows_that_sample_nothing_are_refused_and_change_nothing(rows, words, native):
    sc = compiler(native)
    before = sc.snapshot()
    with pytest.raises(MetadataError) as e:
        sc.append_placeholders(np.array(rows))
    assert words in str(e.value), str(e.value)
    assert not snapshot_diff(before, sc.snapshot())


def test_a_row_at_max_model_len_takes_no_placeholder_one_below_does(native):
    sc = compiler(native, max_model_len=5)  # B holds 5 tokens: its next token would be the 6th
    before = sc.snapshot()
    with pytest.raises(MetadataError, match="request 'B' samples no token this step "
                                            r"\(seq_len 5, num_tokens 5, max_model_len 5\)"):
        sc.append_placeholders(np.array([sc.input_batch.req_id_to_index["B"]]))
    assert not snapshot_diff(before, sc.snapshot())
    ph = sc.append_placeholders([np.int64(sc.input_batch.req_id_to_index["A"])])  # A: 3 < 5 (a scalar is refused: 1-D rows)
    assert ph.req_ids == ("A",) and ph.positions.tolist() == [3]


def test_placeholders_are_patched_after_a_reorder_and_filled_where_the_requests_went(native):
    sc = compiler(native)
    b = sc.input_batch
    rA, rB = b.req_id_to_index["A"], b.req_id_to_index["B"]
    ph = sc.append_placeholders(np.array([rA, rB]))
    # next step: C (still prefilling, 2 tokens) first, then B, then A decode their placeholders
    so = SchedulerOutput([], CachedRequestData(["C", "B", "A"], [False] * 3, [[], [], []], [None] * 3, [2, 5, 3]),
                         {"C": 2, "B": 1, "A": 1})
    sc.update_states(so)
    dev = torch.tensor([70, 71], dtype=torch.int64)  # the previous step's sampled tensor: A, B
    inputs = sc.prepare_inputs(so, prev_token_ids=dev)
    q = inputs.query_start_loc_cpu.tolist()
    row = b.req_id_to_index
    assert inputs.input_ids[q[row["A"]]].item() == 70 and inputs.input_ids[q[row["B"]]].item() == 71
    assert (b.prev_sampled_index[:b.num_reqs] == -1).all(), "the plan consumes the columns"
    assert sc.patch_counts == {"slice": 1, "scatter": 0}  # decodes first: A and B lead the batch again
    assert sc.fill_output_tokens(ph, [70, 71]) == 2
    assert b.token_ids_cpu[row["A"], 3] == 70 and b.token_ids_cpu[row["B"], 5] == 71
    with pytest.raises(MetadataError, match="request 'A' has no placeholder at position 3"):
        sc.fill_output_tokens(ph, [70, 71])  # filled twice
    with pytest.raises(MetadataError, match="fill_output_tokens: 1 tokens for 2 placeholders"):
        sc.fill_output_tokens(ph, [70])
    for unsized in (70, (t for t in [70, 71])):  # no length: named as the value, not a count
        with pytest.raises(MetadataError, match=r"fill_output_tokens: token ids must be ints in \[0, 2\*\*31\), "
                                                r"as a list or a 1-D integer array, got (70|<generator)"):
            sc.fill_output_tokens(ph, unsized)
    with pytest.raises(MetadataError, match=r"fill_output_tokens: token ids must be ints in \[0, 2\*\*31\), got \[-3, 71\]"):
        sc.fill_output_tokens(ph, [-3, 71])


def test_the_steady_state_patches_by_one_slice(native):
    sc = compiler(native)
    b = sc.input_batch
    rA, rB = b.req_id_to_index["A"], b.req_id_to_index["B"]
    sc.append_placeholders(np.array([rA, rB]))  # entry i is row i's token
    so = SchedulerOutput([], CachedRequestData(["A", "B"], [False] * 2, [[], []], [None] * 2, [3, 5]), {"A": 1, "B": 1})
    sc.update_states(so)
    inputs = sc.prepare_inputs(so, prev_token_ids=torch.tensor([70, 71] if rA == 0 else [71, 70]))
    assert sc.patch_counts == {"slice": 1, "scatter": 0}
    assert inputs.input_ids[:2].tolist() == ([70, 71] if rA == 0 else [71, 70])


def test_a_finished_request_is_skipped_and_a_detached_one_filled(native):
    sc = compiler(native)
    b = sc.input_batch
    ph = sc.append_placeholders(np.array([b.req_id_to_index["A"], b.req_id_to_index["B"]]))
    sc.update_states(SchedulerOutput([], CachedRequestData(), {}, finished_req_ids={"A"}))
    assert "B" not in b.req_id_to_index  # unscheduled: B's history is detached from the batch
    assert sc.fill_output_tokens(ph, [70, 71]) == 1
    assert sc.requests["B"].all_token_ids[5] == 71 and "A" not in sc.requests


def test_an_id_that_cannot_be_looked_up_changes_nothing(native):
    """A hand-made ``Placeholders`` whose ids are looked up (no layout recorded): an
    unhashable one fails the lookup on both kernels before any write (the compiled pass
    looks up only ``str`` ids and leaves the rest to the numpy code)."""
    sc = compiler(native)
    b = sc.input_batch
    ph = sc.append_placeholders(np.array([b.req_id_to_index["A"], b.req_id_to_index["B"]]))
    before = sc.snapshot()
    with pytest.raises(TypeError, match="unhashable"):
        sc.fill_output_tokens(Placeholders(("A", ["B"]), ph.positions, ph.rows, None), [70, 71])
    assert not snapshot_diff(before, sc.snapshot())


@pytest.mark.parametrize("contiguous", [True, False])
def test_patch_input_ids_by_slice_and_by_scatter(contiguous):
    ids = torch.arange(10, 16, dtype=torch.int32)
    prev = torch.tensor([7, 8, 9], dtype=torch.int64)
    if contiguous:
        plan = PatchPlan(np.arange(2, dtype=np.int64), np.arange(2, dtype=np.int64), True)
        want = [7, 8, 12, 13, 14, 15]
    else:
        plan = PatchPlan(np.array([4, 1], dtype=np.int64), np.array([0, 2], dtype=np.int64), False)
        want = [10, 9, 12, 13, 7, 15]
    patch_input_ids(ids, plan, prev)
    assert ids.tolist() == want and ids.dtype == torch.int32
