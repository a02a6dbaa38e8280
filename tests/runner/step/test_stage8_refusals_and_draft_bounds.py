"""Stage 8 and drafts at their edges, found by mutation testing (docs/mutation-testing.md): ragged
appends and their typing rule (ints only, rows too), placeholders patched by slice step
after step, draft ids 0 and 1 on both checking paths, the verified tokens' range, the int
packers' bounds. Each refusal leaves the state unchanged; no ``ATTNPLUG_VALIDATE`` needed.
The step helpers are ``test_stage1_refusals_and_bounds``'s."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from attnplug.runner.step.compiler import snapshot_diff
from attnplug.runner.step.scheduler_output import SamplingParams, SchedulerOutput

sys.path.insert(0, str(Path(__file__).parent))
from test_stage1_refusals_and_bounds import cached, one_group, refused  # noqa: E402


def test_append_output_tokens_ragged_and_bounds():
    from attnplug.core.errors import MetadataError
    sc = one_group(False)
    so = SchedulerOutput([], cached(["A", "B"], [6, 2]), {"A": 1, "B": 1})
    sc.update_states(so)
    sc.prepare_inputs(so)
    b = sc.input_batch
    rA, rB = b.req_id_to_index["A"], b.req_id_to_index["B"]
    before = sc.snapshot()
    with pytest.raises(MetadataError, match=r"token ids must be ints in \[0, 2\*\*31\)"):
        sc.append_output_tokens(["A", "B"], [1, 2**31])
    assert not snapshot_diff(before, sc.snapshot())
    for bad in (["5", 2], [1.5, 2], [True, 2], [[1], ["x"]], [2**70, 1]):  # one typing rule: ints only
        with pytest.raises(MetadataError, match="token ids must be ints"):
            sc.append_output_tokens(["A", "B"], bad)
        assert not snapshot_diff(before, sc.snapshot())
    sc.append_output_tokens([rB, rA], [[20, 21, 22], [30, 31]])  # several tokens a row (accepted drafts)
    assert b.token_ids_cpu[rA, 7:10].tolist() == [30, 31, 0] and b.num_tokens[rA] == 9
    assert b.token_ids_cpu[rB, 3:6].tolist() == [20, 21, 22] and b.num_tokens[rB] == 6



@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("tokens", [([30, 31], [20, 21]), [(30, 31), (20, 21)], (np.array([30, 31]), [20, 21]),
                                    np.array([[30, 31], [20, 21]])],
                         ids=["tuple of lists", "list of tuples", "tuple with an array", "2-D array"])
def test_append_output_tokens_takes_a_row_of_tokens_in_any_container(native, tokens):
    """Several tokens a row, in any container the typing rule takes (a tuple, tuples, a 2-D
    array: one row each), append on both kernels as a list of lists does."""
    sc = one_group(native)
    so = SchedulerOutput([], cached(["A", "B"], [6, 2]), {"A": 1, "B": 1})
    sc.update_states(so)
    sc.prepare_inputs(so)
    b = sc.input_batch
    sc.append_output_tokens([b.req_id_to_index["A"], b.req_id_to_index["B"]], tokens)
    rA, rB = b.req_id_to_index["A"], b.req_id_to_index["B"]
    assert b.token_ids_cpu[rA, 6:10].tolist() == [9, 30, 31, 0] and b.num_tokens[rA] == 9
    assert b.token_ids_cpu[rB, 2:6].tolist() == [10, 20, 21, 0] and b.num_tokens[rB] == 5

def test_patch_counts_count_every_patched_step():
    import torch
    sc, ph = one_group(False), None
    for step in range(3):
        blocks = [([6],), ([7],)] if step == 2 else None  # A: 9th token, B: 5th: a new block each
        so = SchedulerOutput([], cached(["A", "B"], [6 + step, 2 + step], blocks=blocks), {"A": 1, "B": 1})
        sc.update_states(so)
        sc.prepare_inputs(so, prev_token_ids=None if ph is None else torch.tensor([50, 51]))
        if ph is not None:
            sc.fill_output_tokens(ph, [50, 51])
        b = sc.input_batch
        ph = sc.append_placeholders(np.array([b.req_id_to_index["A"], b.req_id_to_index["B"]]))
    assert sc.patch_counts == {"slice": 2, "scatter": 0}


def test_an_int_packer_reports_zero_bounds_before_any_pack():
    from attnplug.runner.step.int_packer import IntPacker
    from attnplug.runner.step.kernels import choose_kernels
    for native in (False, True):
        p = IntPacker(choose_kernels(native, SamplingParams))
        assert (p.min, p.max, p.flat.shape[0]) == (0, 0, 0)
        views = p.pack([[3, 9], [4]])
        assert (p.min, p.max) == (3, 9) and [v.tolist() for v in views] == [[3, 9], [4]]


@pytest.mark.parametrize("call", ["append_output_tokens", "append_verified_tokens", "append_placeholders"])
@pytest.mark.parametrize("rows", [[1.0], [True], ["0"], np.array([0.0])])
def test_stage_8_rows_must_be_ints(call, rows):
    """One typing rule: numpy would take ``1.0`` or ``"0"`` as a row index."""
    from attnplug.core.errors import MetadataError
    sc = one_group(False)
    so = SchedulerOutput([], cached(["A", "B"], [6, 2]), {"A": 1, "B": 1})
    sc.update_states(so)
    sc.prepare_inputs(so)
    before = sc.snapshot()
    args = {"append_output_tokens": ([5],), "append_verified_tokens": ([[5]],), "append_placeholders": ()}[call]
    words = f"{call}: rows must be ints"
    if call == "append_output_tokens" and isinstance(rows, list) and isinstance(rows[0], str):
        words = "request '0' is not in this step's batch"  # strings there are request ids
    with pytest.raises(MetadataError, match=words):
        getattr(sc, call)(rows, *args)
    assert not snapshot_diff(before, sc.snapshot())
    getattr(sc, call)(np.array([0], dtype=np.int32), *args)  # an integer array is fine


@pytest.mark.parametrize("native", [False, True])
def test_draft_ids_zero_and_one_are_drafts_bools_are_not(native):
    sc = make_spec(native)
    sc.update_states(SchedulerOutput([], cached(["A"], [7], blocks=[([4],)]), {"A": 3},
                                     scheduled_spec_decode_tokens={"A": [1, 0]}))
    r = sc.input_batch.req_id_to_index["A"]
    assert sc.input_batch.token_ids_cpu[r, 8:10].tolist() == [1, 0]
    sc = make_spec(native)
    e = refused(sc, SchedulerOutput([], cached(["A"], [7]), {"A": 2}, scheduled_spec_decode_tokens={"A": [True]}))
    assert e.field == "scheduled_spec_decode_tokens", str(e)


def make_spec(native: bool) -> StepCompiler:
    """A decoding: 8 tokens held, 7 computed (one_group, then A's next token)."""
    sc = one_group(native)
    so = SchedulerOutput([], cached(["A"], [6]), {"A": 1})
    sc.update_states(so)
    sc.prepare_inputs(so)
    sc.append_output_tokens(["A"], [11])
    return sc


def test_verified_tokens_out_of_range_are_refused():
    from attnplug.core.errors import MetadataError
    for bad in ([2**31], [-1]):
        sc = make_spec(False)
        so = SchedulerOutput([], cached(["A"], [7], blocks=[([4],)]), {"A": 2}, scheduled_spec_decode_tokens={"A": [5]})
        sc.update_states(so)
        sc.prepare_inputs(so)
        before = sc.snapshot()
        with pytest.raises(MetadataError, match=r"token ids must be ints in \[0, 2\*\*31\)"):
            sc.append_verified_tokens([sc.input_batch.req_id_to_index["A"]], [bad])
        assert not snapshot_diff(before, sc.snapshot())


def test_an_int_packer_packs_empty_sequences():
    from attnplug.runner.step.int_packer import IntPacker
    from attnplug.runner.step.kernels import choose_kernels
    for native in (False, True):
        p = IntPacker(choose_kernels(native, SamplingParams))
        p.pack([[7]])
        views = p.pack([[], []])
        assert [v.tolist() for v in views] == [[], []] and (p.min, p.max) == (0, 0)


def test_a_draft_id_zero_is_a_draft_on_the_per_request_path_too():
    """Drafts as a tuple take the per-request loop (the vectorized check wants lists)."""
    sc = make_spec(False)
    sc.update_states(SchedulerOutput([], cached(["A"], [7], blocks=[([4],)]), {"A": 3},
                                     scheduled_spec_decode_tokens={"A": (0, 1)}))
    r = sc.input_batch.req_id_to_index["A"]
    assert sc.input_batch.token_ids_cpu[r, 8:10].tolist() == [0, 1]
