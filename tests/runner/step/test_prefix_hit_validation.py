"""The step compiler with prefix-cache hits: new requests that start at
``num_computed_tokens > 0`` on blocks shared with other requests are accepted, and a block
list in which a position some query of the step can see sits in the null block is
``InvalidSchedulerOutput`` (request id, field) with the state unchanged, on the numpy and
compiled paths. ``validate()`` (invariant 7) checks the same on the metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import InvalidSchedulerOutput, MetadataInvariantError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.validation import validate
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

W = 5  # sliding window of group 1; block size 4 in both groups
SYSTEM = list(range(1, 13))  # 12 shared tokens: three blocks


def compiler(native: bool) -> StepCompiler:
    """A computed the shared prefix and holds blocks 1..4 (full) and 11..14 (window)."""
    sc = StepCompiler([4, 4], max_num_reqs=4, max_model_len=32, max_num_batched_tokens=32, num_blocks=32,
                      group_kinds=["full_attention", "sliding_window"], sliding_windows=[None, W],
                      validate=True, native=native)
    sc.update_states(SchedulerOutput([NewRequestData("A", SYSTEM + [50, 51], ([1, 2, 3, 4], [11, 12, 13, 14]))],
                                     CachedRequestData(), {"A": 14}))
    sc.prepare_inputs()
    return sc


def step_with(new: list[NewRequestData], counts: dict) -> SchedulerOutput:
    return SchedulerOutput(new, CachedRequestData(["A"], [False], [[60]], [None], [14]), {"A": 1, **counts})


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "compiled"])
def test_two_new_requests_share_the_prefix_blocks_with_a_running_one(native):
    sc = compiler(native)
    # W = 5 at h = 12: queries from 12 see keys from 8 on, so window blocks 0 and 1 may be null
    b = NewRequestData("B", SYSTEM + [70, 71], ([1, 2, 3, 5], [0, 0, 13, 15]), num_computed_tokens=12)
    c = NewRequestData("C", SYSTEM + [80], ([1, 2, 3, 6], [0, 0, 13, 16]), num_computed_tokens=12)
    sc.update_states(step_with([b, c], {"B": 2, "C": 1}))
    inputs = sc.prepare_inputs()
    rows = {rid: i for i, rid in enumerate(inputs.req_ids)}
    bt = sc.input_batch.block_table[0].block_table_np
    assert (bt[rows["B"], :3] == bt[rows["A"], :3]).all() and (bt[rows["C"], :3] == [1, 2, 3]).all()
    assert inputs.positions[:inputs.num_actual_tokens].tolist() == [14, 12, 13, 12]


BAD = [
    # (why, block ids, num_computed_tokens)
    ("full-attention prefix block is null", ([1, 0, 3, 5], [0, 0, 13, 15]), 12),
    ("the window's block before the hit point is null", ([1, 2, 3, 5], [0, 0, 0, 15]), 12),
    ("a block of the window reaching back to 8 is null", ([1, 2, 3, 5], [0, 0, 13, 0]), 12),
]


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize("why, blocks, ncts", BAD, ids=[b[0] for b in BAD])
def test_a_visible_position_in_the_null_block_is_refused_before_any_change(native, why, blocks, ncts):
    sc = compiler(native)
    before = sc.snapshot()
    bad = NewRequestData("B", SYSTEM + [70, 71], blocks, num_computed_tokens=ncts)
    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(step_with([bad], {"B": 2}))
    assert e.value.req_id == "B" and e.value.field == "block_ids"
    assert "null block" in str(e.value)
    assert not snapshot_diff(before, sc.snapshot())


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "compiled"])
def test_a_resumed_request_with_a_hit_is_checked_like_a_new_one(native):
    sc = compiler(native)
    sc.update_states(SchedulerOutput([], CachedRequestData(), {}))  # A unscheduled, kept
    before = sc.snapshot()
    resumed = CachedRequestData(["A"], [True], [[]], [([1, 2, 3, 4], [0, 0, 0, 14])], [12])
    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(SchedulerOutput([], resumed, {"A": 2}))
    assert (e.value.req_id, e.value.field) == ("A", "new_block_ids")
    assert not snapshot_diff(before, sc.snapshot())
    ok = CachedRequestData(["A"], [True], [[]], [([1, 2, 3, 4], [0, 0, 13, 14])], [12])
    sc.update_states(SchedulerOutput([], ok, {"A": 2}))
    sc.prepare_inputs()


def test_validate_refuses_a_null_block_a_full_attention_query_can_see():
    cm = CommonAttentionMetadata.from_lengths([12, 12], [2, 1], [[1, 2, 3, 5], [1, 0, 3, 6]], block_size=4)
    validate(CommonAttentionMetadata.from_lengths([12], [2], [[1, 2, 3, 5]], block_size=4), block_size=4,
             full_attention=True)
    validate(cm, block_size=4)  # without the flag the middle null is not looked at
    with pytest.raises(MetadataInvariantError, match="full-attention block"):
        validate(cm, block_size=4, full_attention=True)
