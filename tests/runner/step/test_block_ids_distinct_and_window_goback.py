"""Issue 39's stage-1 holes, on both paths: a block id repeated in one request's list of
one group is refused (two real tokens would write one slot), sharing across requests
stays legal; a go-back whose queries would see keys in blocks the runner already nulled
is refused before any change; ``validate()`` fails a step whose real slots repeat."""

from __future__ import annotations

import pytest

from attnplug.core.errors import InvalidSamplingParams, InvalidSchedulerOutput, MetadataError
from attnplug.core.errors import MetadataInvariantError
from attnplug.core.validation import validate
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

PATHS = [False] + ([True] if NATIVE is not None else [])


def _refused(sc: StepCompiler, so: SchedulerOutput, req_id, field: str, words: str) -> None:
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(so)
    assert (info.value.req_id, info.value.field) == (req_id, field), str(info.value)
    assert words in str(info.value), str(info.value)
    assert not snapshot_diff(before, sc.snapshot())


@pytest.mark.parametrize("native", PATHS)
def test_a_block_twice_in_one_prefill_list_is_refused(native):
    sc = StepCompiler([4], 2, 32, 16, native=native, validate=True)
    so = SchedulerOutput([NewRequestData("r", list(range(8)), ([1, 1],))], CachedRequestData(), {"r": 8})
    _refused(sc, so, "r", "block_ids", "block id 1 appears twice")


@pytest.mark.parametrize("native", PATHS)
def test_a_block_shared_by_two_requests_and_repeated_nulls_stay_legal(native):
    sc = StepCompiler([4, 4], 2, 32, 16, native=native, validate=True, num_blocks=32,
                      group_kinds=["full_attention", "sliding_window"])
    # the same full-attention prefix blocks (prefix sharing), and a null skipped prefix
    sc.update_states(SchedulerOutput([NewRequestData("a", list(range(9)), ([1, 2, 3], [0, 0, 4]), 8),
                                      NewRequestData("b", list(range(9)), ([1, 2, 5], [0, 0, 6]), 8)],
                                     CachedRequestData(), {"a": 1, "b": 1}))
    inp = sc.prepare_inputs()
    assert inp.req_ids == ["a", "b"]


@pytest.mark.parametrize("native", PATHS)
def test_an_appended_block_the_row_already_holds_is_refused(native):
    sc = StepCompiler([4], 2, 32, 16, native=native, validate=True)
    sc.update_states(SchedulerOutput([NewRequestData("r", list(range(8)), ([3, 4],))], CachedRequestData(), {"r": 8}))
    sc.prepare_inputs()
    sc.append_output_tokens(["r"], [9])
    so = SchedulerOutput([], CachedRequestData(["r"], [False], [[]], [([3],)], [8]), {"r": 1})
    _refused(sc, so, "r", "new_block_ids", "block id 3 appears twice")
    sc.update_states(SchedulerOutput([], CachedRequestData(["r"], [False], [[]], [([5],)], [8]), {"r": 1}))
    assert sc.prepare_inputs().slot_mapping[0].tolist()[:1] == [20]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("appended", [([4],), ([5, 4],)])  # one block (the decode case), or two
def test_an_appended_block_equal_to_the_rows_largest_held_id_is_refused(native, appended):
    """The held ids are read only for an appended id at or below the row's
    ``block_id_bound`` (its largest held id here): the id equal to it is read and refused,
    in the second row of the step (the first appends a fresh id)."""
    sc = StepCompiler([4], 2, 32, 16, native=native, validate=True)
    sc.update_states(SchedulerOutput([NewRequestData("q", list(range(8)), ([1, 2],)),
                                      NewRequestData("r", list(range(8)), ([3, 4],))], CachedRequestData(),
                                     {"q": 8, "r": 8}))
    sc.prepare_inputs()
    sc.append_output_tokens(["q", "r"], [9, 9])
    so = SchedulerOutput([], CachedRequestData(["q", "r"], [False] * 2, [[], []], [([6],), appended], [8, 8]),
                         {"q": 1, "r": 1})
    _refused(sc, so, "r", "new_block_ids", "block id 4 appears twice")


@pytest.mark.parametrize("native", PATHS)
def test_a_block_twice_in_an_appended_list_names_its_request_and_group(native):
    """Appended ids above every held one (no held id is read): the new lists alone are
    checked, all groups at once; the error names the third request and group 1."""
    sc = StepCompiler([4, 4], 3, 32, 32, native=native, validate=True, num_blocks=32)
    sc.update_states(SchedulerOutput([NewRequestData(r, list(range(8)), ([2 * i + 1, 2 * i + 2],) * 2)
                                      for i, r in enumerate("pqr")], CachedRequestData(), dict.fromkeys("pqr", 8)))
    sc.prepare_inputs()
    sc.append_output_tokens(list("pqr"), [9, 9, 9])
    appended = [([10, 11], [10, 11]), ([12, 13], [12, 13]), ([14, 15], [16, 16])]
    so = SchedulerOutput([], CachedRequestData(list("pqr"), [False] * 3, [[]] * 3, appended, [8] * 3),
                         dict.fromkeys("pqr", 1))
    _refused(sc, so, "r", "new_block_ids", "group 1: block id 16 appears twice")


def _window_request_at_20(native: bool) -> StepCompiler:
    """One request in a sliding-window group (W 6, blocks of 4, kernel blocks of 2) at
    ``num_computed_tokens`` 20: the runner nulled blocks 0..2 (keys 0..11)."""
    sc = StepCompiler([4], 2, 32, 32, kernel_block_sizes=[2], num_blocks=32, group_kinds=["sliding_window"],
                      sliding_windows=[6], native=native, validate=True)
    sc.update_states(SchedulerOutput([NewRequestData("r", list(range(24)), ([1, 2, 3, 4, 5, 6],))],
                                     CachedRequestData(), {"r": 20}))
    sc.prepare_inputs()
    sc.update_states(SchedulerOutput([], CachedRequestData(["r"], [False], [[]], [None], [20]), {"r": 1}))
    sc.prepare_inputs()
    assert sc.input_batch.block_table[0].block_table_np[0, :6].tolist() == [0, 0, 0, 4, 5, 6]
    return sc


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("back_to", [2, 11, 13, 14, 16])
def test_a_goback_whose_window_sees_a_nulled_block_is_refused(native, back_to):
    """The refusal names the first key the queries see: ``max(0, back_to - W + 1)``."""
    sc = _window_request_at_20(native)
    so = SchedulerOutput([], CachedRequestData(["r"], [False], [[]], [None], [back_to]), {"r": 1})
    _refused(sc, so, "r", "num_computed_tokens", f"group 0: {back_to} is behind the sliding window the runner "
             f"already applied (20 tokens computed, window 6): its queries see keys from position "
             f"{max(0, back_to - 5)} on, but blocks [0, 3) of 4 tokens were freed and nulled")


@pytest.mark.parametrize("native", PATHS)
def test_a_goback_whose_window_sees_only_live_blocks_is_accepted(native):
    sc = _window_request_at_20(native)  # queries from 17 see keys 12.. (block 3 on): live
    sc.update_states(SchedulerOutput([], CachedRequestData(["r"], [False], [[]], [None], [17]), {"r": 1}))
    assert sc.prepare_inputs().positions.tolist() == [17]


def test_validate_fails_a_step_whose_real_slots_repeat():
    sc = StepCompiler([4], 2, 32, 16)
    sc.update_states(SchedulerOutput([NewRequestData("r", list(range(8)), ([1, 2],))], CachedRequestData(), {"r": 8}))
    inp = sc.prepare_inputs()
    cm = inp.common_attn_metadata[0]
    validate(cm, block_size=4)  # the real step passes
    # hand-made: the row's list says [1, 1], so tokens 4..7 write block 1's slots again
    cm.block_table_tensor[0, 1] = 1
    cm.slot_mapping[4:8] = cm.slot_mapping[0:4].clone()
    with pytest.raises(MetadataInvariantError) as info:
        validate(cm, block_size=4)
    assert info.value.invariant == "7 slots" and info.value.values["tokens"] == [0, 4]


@pytest.mark.parametrize("native", PATHS)
def test_a_non_str_request_id_is_named_as_such(native):
    sc = StepCompiler([4], 2, 32, 16, native=native)
    sc.update_states(SchedulerOutput([NewRequestData("r", [1, 2], ([1],))], CachedRequestData(), {"r": 2}))
    sc.prepare_inputs()
    sc.append_output_tokens(["r"], [3])
    so = SchedulerOutput([], CachedRequestData(["r", 7], [False, False], [[], []], [None, None], [2, 0]),
                         {"r": 1, 7: 1})
    _refused(sc, so, None, "scheduled_cached_reqs.req_ids", "request ids must be str, got int 7")
    with pytest.raises(MetadataError, match=r"append_output_tokens: request ids must be str \(or pass batch rows, all "
                                            r"ints\), got int 7$"):
        sc.append_output_tokens(["r", 7], [1, 2])


@pytest.mark.parametrize("native", PATHS)
def test_an_unhashable_id_after_a_readded_one_is_refused_not_a_type_error(native):
    sc = StepCompiler([4], 2, 32, 16, native=native)
    sc.update_states(SchedulerOutput([NewRequestData("a", [1, 2], ([1],)), NewRequestData("c", [1, 2], ([2],))],
                                     CachedRequestData(), {"a": 2, "c": 2}))
    sc.prepare_inputs()
    sc.update_states(SchedulerOutput([], CachedRequestData(["a"], [False], [[5]], [None], [2]), {"a": 1}))
    sc.prepare_inputs()  # c: resident, not in the batch
    so = SchedulerOutput([], CachedRequestData(["c", ["x"]], [False, False], [[], []], [None, None], [1, 0]),
                         {"c": 1})
    _refused(sc, so, None, "scheduled_cached_reqs.req_ids", "request ids must be str, got list")


def test_max_tokens_below_one_is_refused_at_construction():
    for bad in (0, -1, True, 1.0):
        with pytest.raises(InvalidSamplingParams, match="max_tokens must be an int >= 1"):
            SamplingParams(max_tokens=bad)
    assert SamplingParams(max_tokens=1).max_tokens == 1


def test_repeated_block_agrees_with_a_per_list_search():
    """``check.lists.repeated_block`` (its one-compare case for lists that ascend, and the
    full check) against a plain per-list search, on random lists: ascending ones (the
    pool's order, descents only where a list ends), some with a repeat, some with nulls."""
    import numpy as np

    from attnplug.runner.step.check.lists import repeated_block

    rng = np.random.default_rng(0)
    for _ in range(400):
        lens = rng.integers(0, 5, size=int(rng.integers(1, 6))).tolist()
        lists = [sorted(rng.choice(np.arange(1, 40), size=n, replace=False).tolist()) for n in lens]
        for lst in lists:
            if lst and rng.random() < 0.25:
                lst.insert(int(rng.integers(0, len(lst) + 1)), int(rng.choice(lst)))  # a repeat
            if lst and rng.random() < 0.15:
                lst[:0] = [0, 0]  # a skipped sliding-window prefix: null may repeat
        flat = np.asarray([x for lst in lists for x in lst], dtype=np.int32)
        want = next(((i, next(x for x in lst if x and lst.count(x) > 1)) for i, lst in enumerate(lists)
                     if any(x and lst.count(x) > 1 for x in lst)), None)
        got = repeated_block(flat, [len(lst) for lst in lists])
        assert (got is None) == (want is None), (lists, got)
        if want is not None:
            assert got[0] == want[0] and lists[got[0]].count(got[1]) > 1, (lists, got)


def test_a_repeat_inside_a_list_is_found_behind_an_empty_list():
    """``repeated_block``'s one-compare case (descents only where lists end) counts each
    list end once: an empty list (two ends at one index) does not hide a repeat inside
    the next list."""
    import numpy as np

    from attnplug.runner.step.check.lists import repeated_block
    flat = np.array([5, 6, 1, 2, 3, 3], dtype=np.int32)
    assert repeated_block(flat, [2, 0, 4]) == (2, 3)
    assert repeated_block(np.array([5, 6, 1, 2, 3, 4], dtype=np.int32), [2, 0, 4]) is None
