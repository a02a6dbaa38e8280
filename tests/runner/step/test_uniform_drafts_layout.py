"""A step where every row verifies the same number of drafts (a fixed
``num_speculative_tokens``: the usual steady step) is laid out by the compiled kernels'
branch-free loops (``SpecLayout._uniform``); a step that breaks any of its conditions
(a row with another count, a row without drafts, a row whose logits are discarded) takes
the general loop. Both give the worked example's layout, on both kernels."""

from __future__ import annotations

import pytest

from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

NATIVE = [False] + ([True] if kernels_available() else [])


def _step(native: bool, drafts: dict[str, list[int]], chunked_c: bool = False):
    """Three decoding rows a, b, c (``chunked_c``: c is still prefilling, its logits
    discarded); ``drafts`` per request; returns the step's inputs."""
    sc = StepCompiler([4], 4, 32, 32, num_blocks=16, native=native)
    new = [NewRequestData("a", list(range(5)), ([1, 2],), 4), NewRequestData("b", list(range(6)), ([3, 4],), 5),
           NewRequestData("c", list(range(7 if not chunked_c else 8)), ([5, 6],), 6 if not chunked_c else 2)]
    first = SchedulerOutput(new, CachedRequestData(), {"a": 1, "b": 1, "c": 1 if not chunked_c else 2})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens(["a", "b"] + ([] if chunked_c else ["c"]), [7, 8] + ([] if chunked_c else [9]))
    cached = CachedRequestData(["a", "b", "c"], [False] * 3, [[], [], []], [None, ([10],), ([11],)],
                               [5, 6, 7 if not chunked_c else 4])
    counts = {r: 1 + len(drafts.get(r, [])) for r in "abc"}
    if chunked_c:
        counts["c"] = 2
    so = SchedulerOutput([], cached, counts, scheduled_spec_decode_tokens=drafts)
    sc.update_states(so)
    return sc.prepare_inputs(so)


@pytest.mark.parametrize("native", NATIVE)
def test_every_row_verifying_two_drafts_is_laid_out_request_by_request(native):
    inputs = _step(native, {"a": [11, 12], "b": [13, 14], "c": [15, 16]})
    m = inputs.spec_decode_metadata
    assert inputs.input_ids.tolist() == [7, 11, 12, 8, 13, 14, 9, 15, 16]
    assert m.num_draft_tokens == [2, 2, 2]
    assert m.draft_token_ids.tolist() == [11, 12, 13, 14, 15, 16]
    assert m.cu_num_draft_tokens.tolist() == [2, 4, 6]
    assert m.logits_indices.tolist() == list(range(9))
    assert m.target_logits_indices.tolist() == [0, 1, 3, 4, 6, 7]
    assert m.bonus_logits_indices.tolist() == [2, 5, 8]


@pytest.mark.parametrize("native", NATIVE)
def test_rows_with_other_counts_take_the_general_layout(native):
    inputs = _step(native, {"a": [11, 12], "b": [13], "c": [15, 16]})  # b: one draft
    m = inputs.spec_decode_metadata
    assert m.num_draft_tokens == [2, 1, 2]
    assert m.draft_token_ids.tolist() == [11, 12, 13, 15, 16]
    assert m.cu_num_draft_tokens.tolist() == [2, 3, 5]
    assert m.target_logits_indices.tolist() == [0, 1, 3, 5, 6]
    assert m.bonus_logits_indices.tolist() == [2, 4, 7]
    inputs = _step(native, {"a": [11, 12], "c": [15, 16]})  # b: no drafts
    m = inputs.spec_decode_metadata
    assert m.num_draft_tokens == [2, 0, 2]
    assert m.logits_indices.tolist() == list(range(7))
    assert m.target_logits_indices.tolist() == [0, 1, 4, 5]
    assert m.bonus_logits_indices.tolist() == [2, 3, 6]


@pytest.mark.parametrize("native", NATIVE)
def test_a_row_whose_logits_are_discarded_leaves_the_layout(native):
    inputs = _step(native, {"a": [11, 12], "b": [13, 14]}, chunked_c=True)  # c: a prefill chunk
    assert inputs.discard.tolist() == [False, False, True]
    m = inputs.spec_decode_metadata
    assert m.num_draft_tokens == [2, 2]
    assert m.logits_indices.tolist() == list(range(6))
    assert m.target_logits_indices.tolist() == [0, 1, 3, 4]
    assert m.bonus_logits_indices.tolist() == [2, 5]
    assert m.draft_token_ids.tolist() == [11, 12, 13, 14]
