"""``fill_output_tokens`` writes into the rows ``append_placeholders`` recorded only while
no request has left its row since (``InputBatch.layout`` is the same object); a swap, a
move (condense) or a removal replaces the layout, an admission into a free row does not,
and after any of them the tokens still reach the requests they belong to. Two requests
whose placeholders sit at the same position make a wrong row visible: the table check
alone would not catch it."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.placeholders import PLACEHOLDER_TOKEN_ID
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


def _two_decoding(native: bool) -> tuple[StepCompiler, object]:
    """A and B (3 tokens each) after one step, each with a placeholder at position 3."""
    sc = StepCompiler([4], max_num_reqs=4, max_model_len=16, max_num_batched_tokens=16, num_blocks=32,
                      native=native)
    so = SchedulerOutput([NewRequestData("A", [1, 2, 3], ([1],)), NewRequestData("B", [4, 5, 6], ([2],))],
                         CachedRequestData(), {"A": 3, "B": 3})
    sc.update_states(so)
    sc.prepare_inputs(so)
    b = sc.input_batch
    ph = sc.append_placeholders(np.array([b.req_id_to_index["A"], b.req_id_to_index["B"]]))
    return sc, ph


def _token_at_3(sc: StepCompiler, rid: str) -> int:
    b = sc.input_batch
    row = b.req_id_to_index.get(rid)
    return int(b.token_ids_cpu[row, 3]) if row is not None else int(sc.requests[rid].all_token_ids[3])


@pytest.mark.parametrize("native", [False, True])
def test_rows_are_trusted_while_the_layout_holds(native):
    sc, ph = _two_decoding(native)
    b = sc.input_batch
    assert ph.layout is b.layout and ph.rows.tolist() == [b.req_id_to_index["A"], b.req_id_to_index["B"]]
    saved, b.req_id_to_index = b.req_id_to_index, _CountingDict(b.req_id_to_index)
    try:
        assert sc.fill_output_tokens(ph, [70, 71]) == 2
        assert b.req_id_to_index.lookups == 0  # the recorded rows, no id looked up
    finally:
        b.req_id_to_index = saved
    assert (_token_at_3(sc, "A"), _token_at_3(sc, "B")) == (70, 71)


class _CountingDict(dict):
    """``req_id_to_index`` that counts its ``get`` / ``[]`` lookups."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)

    def __getitem__(self, key):
        self.lookups += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("change", ["swap", "condense", "remove"])
def test_tokens_follow_the_requests_after_a_row_change(native, change):
    sc, ph = _two_decoding(native)
    b = sc.input_batch
    layout = b.layout
    if change == "swap":
        b.swap_states(b.req_id_to_index["A"], b.req_id_to_index["B"])
    elif change == "condense":  # A leaves a hole (kept state), B moves into it
        b.remove_request("A")
        before = b.layout
        b.condense()
        assert b.layout is not before
    else:
        b.remove_request("A")
    assert b.layout is not layout
    assert sc.fill_output_tokens(ph, [70, 71]) == 2
    assert (_token_at_3(sc, "A"), _token_at_3(sc, "B")) == (70, 71)


def test_admitting_into_a_free_row_keeps_the_layout():
    sc, ph = _two_decoding(False)
    b = sc.input_batch
    layout = b.layout
    so = SchedulerOutput([NewRequestData("C", [7, 7], ([3],))],
                         CachedRequestData(["A", "B"], [False] * 2, [[], []], [None] * 2, [3, 3]),
                         {"A": 1, "B": 1, "C": 2})
    sc.update_states(so)
    assert b.layout is layout and "C" in b.req_id_to_index
    assert sc.fill_output_tokens(ph, [70, 71]) == 2
    assert (_token_at_3(sc, "A"), _token_at_3(sc, "B")) == (70, 71)
    assert PLACEHOLDER_TOKEN_ID not in b.token_ids_cpu[b.req_id_to_index["C"], :2].tolist()
