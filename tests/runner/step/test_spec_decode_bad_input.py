"""Bad ``scheduled_spec_decode_tokens`` raise ``InvalidSchedulerOutput`` naming the request
and the field, and leave the runner state byte-identical, on the compiled and the numpy
path (so do more drafts than a state group's slots); a valid step with drafts lays them out
after each row's tokens (``spec_token_ids``) and ``prepare_inputs`` builds the verification
layout."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.core.errors import InvalidSchedulerOutput, MetadataError
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

PATHS = [pytest.param(False, id="numpy"),
         pytest.param(True, id="compiled", marks=pytest.mark.skipif(NATIVE is None, reason="not built"))]


def make_compiler(native: bool) -> StepCompiler:
    """A decoding (1 token left, 9 held), B prefilling (6 of 12 computed), C resident, unscheduled."""
    sc = StepCompiler([4], max_num_reqs=4, max_model_len=16, max_num_batched_tokens=12, num_blocks=32,
                      validate=True, native=native)
    sc.update_states(SchedulerOutput([
        NewRequestData("A", [1, 2, 3, 4, 5, 6, 7, 8], ([1, 2, 3],)),
        NewRequestData("B", list(range(20, 32)), ([4, 5],)),
        NewRequestData("C", [9, 9], ([6],))], CachedRequestData(), {"A": 8, "B": 2, "C": 2}))
    sc.prepare_inputs()
    sc.append_output_tokens(["A", "C"], [40, 41])
    return sc


def step(drafts: dict, nst: dict | None = None, ncc=(8, 2), blocks=None, new=()) -> SchedulerOutput:
    nst = {"A": 1 + len(drafts.get("A", [])), "B": 4} if nst is None else nst
    cd = CachedRequestData(["A", "B"], [False, False], [[], []], blocks or [None, ([6],)], list(ncc))
    for nr in new:
        nst[nr.req_id] = len(nr.prompt_token_ids)
    return SchedulerOutput(list(new), cd, nst, scheduled_spec_decode_tokens=drafts)


@pytest.mark.parametrize("native", PATHS)
def test_a_valid_step_with_drafts_is_laid_out_after_the_row_tokens(native):
    sc = make_compiler(native)
    so = step({"A": [5, 6, 7]})
    sc.update_states(so)
    inputs = sc.prepare_inputs(so)
    b = sc.input_batch
    r = b.req_id_to_index["A"]
    assert b.num_tokens[r] == 9 and b.num_spec_tokens[r] == 3
    assert b.token_ids_cpu[r, 8:12].tolist() == [40, 5, 6, 7]
    q = inputs.query_start_loc_cpu.tolist()
    assert inputs.input_ids[q[r]:q[r + 1]].tolist() == [40, 5, 6, 7]
    assert inputs.positions[q[r]:q[r + 1]].tolist() == [8, 9, 10, 11]
    assert inputs.seq_lens_cpu[r] == 12 and not inputs.discard[r]
    bt = sc.input_batch.block_table[0]
    want_slots = [bt.block_table_np[r, p // 4] * 4 + p % 4 for p in range(8, 12)]
    assert inputs.slot_mapping[0][q[r]:q[r + 1]].tolist() == want_slots  # a slot for every draft
    md = inputs.spec_decode_metadata
    assert md.num_draft_tokens == [3]  # B's logits are discarded (partial prefill): not verified
    assert md.draft_token_ids.tolist() == [5, 6, 7]
    assert md.logits_indices.tolist() == list(range(q[r], q[r + 1]))
    assert inputs.common_attn_metadata[0].max_query_len == 4
    # stage 8: 2 accepted + 1 corrected token; the drafts are gone, the row holds 9 + 3 tokens
    sc.append_verified_tokens([r], [[5, 6, 9]])
    assert b.num_tokens[r] == 12 and b.num_spec_tokens[r] == 0
    assert sc.requests["A"].all_token_ids[-4:] == [40, 5, 6, 9]


def _bad_cases():
    """``(name, step kwargs, request named, words of the message)``."""
    A = {"A": [5, 6]}
    return [
        ("unknown", dict(drafts={"Z": [1]}), "Z", "unknown request: not in scheduled_cached_reqs$"),
        ("unscheduled resident", dict(drafts={"C": [1]}), "C", "request is resident but not scheduled this step$"),
        ("prefilling row", dict(drafts={"B": [1, 2]}), "B", "row still prefilling: 10 real tokens left to compute "
                                                             "(num_computed_tokens=2 of 12)"),
        ("two tokens left", dict(drafts={"A": [5]}, ncc=(7, 2)), "A", "row still prefilling: 2 real tokens left"),
        ("new request", dict(drafts={"N": [1]}, new=[NewRequestData("N", [3, 3], ([7],))]), "N",
         "drafts for a new request: it is still prefilling"),
        ("more drafts than budget", dict(drafts=A, nst={"A": 2, "B": 4}), "A",
         "2 drafts need num_scheduled_tokens == 1 + 2, got 2 (more drafts than the step's budget for the request)"),
        ("fewer drafts than scheduled", dict(drafts=A, nst={"A": 4, "B": 4}), "A",
         "2 drafts need num_scheduled_tokens == 1 + 2, got 4$"),
        ("beyond max_model_len", dict(drafts={"A": [1] * 8}, nst={"A": 9, "B": 1}, blocks=[([7],), None]), "A",
         "8 drafts after 9 tokens leave no room for the 9 tokens the row may emit within max_model_len=16 "
         "(at most 6 drafts)"),
        # seq_len = 16 would fit, but with every draft accepted the row emits 8 tokens: 17 > 16
        ("at max_model_len", dict(drafts={"A": [1] * 7}, nst={"A": 8, "B": 1}, blocks=[([7],), None]), "A",
         "7 drafts after 9 tokens leave no room for the 8 tokens the row may emit"),
        ("negative id", dict(drafts={"A": [5, -1]}), "A", "draft token ids must be ints in [0, 2**31)"),
        ("id past int32", dict(drafts={"A": [5, 2**31]}), "A", "draft token ids must be ints in [0, 2**31)"),
        ("float id", dict(drafts={"A": [5, 1.0]}), "A", "draft token ids must be ints in [0, 2**31), got [5, 1.0]"),
        ("not a list", dict(drafts={"A": 5}, nst={"A": 2, "B": 4}), "A", "expected a list of draft token ids, got 5"),
        ("nothing real left", dict(drafts=A, ncc=(9, 2)), "A",
         "num_computed_tokens=9 leaves no real token of 9 to compute: a verifying row computes its last token, "
         "then the drafts$"),
        ("request id not str", dict(drafts={7: [1]}), None, "request ids must be str, got 7"),
    ]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name, kw, rid, words", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_drafts_name_request_and_field_and_change_nothing(native, name, kw, rid, words):
    sc = make_compiler(native)
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(step(**kw))
    assert e.value.req_id == rid and e.value.field == "scheduled_spec_decode_tokens", str(e.value)
    msg = str(e.value)  # the words appear as written ("$": and end the message)
    assert (msg.endswith(words[:-1]) if words.endswith("$") else words in msg), msg
    assert not snapshot_diff(before, sc.snapshot())
    so = step({"A": [5]})  # and the state still takes a valid step
    sc.update_states(so)
    sc.prepare_inputs(so)


@pytest.mark.parametrize("native", PATHS)
def test_a_field_that_is_not_a_dict_and_bad_verified_appends(native):
    sc = make_compiler(native)
    before = sc.snapshot()
    so = step({})
    so.scheduled_spec_decode_tokens = [("A", [1])]
    with pytest.raises(InvalidSchedulerOutput, match="scheduled_spec_decode_tokens"):
        sc.update_states(so)
    assert not snapshot_diff(before, sc.snapshot())
    so = step({"A": [5, 6]})
    sc.update_states(so)
    sc.prepare_inputs(so)
    r, rb = sc.input_batch.req_id_to_index["A"], sc.input_batch.req_id_to_index["B"]
    mid = sc.snapshot()
    for rows, toks, msg in [([r], [[1, 2, 3, 4]], "2 drafts"), ([r], [[]], "0 tokens"),
                            ([rb], [[1]], "seq_len"), ([r, r], [[1], [2]], "distinct")]:
        with pytest.raises(MetadataError, match=msg):
            sc.append_verified_tokens(rows, toks)
        assert not snapshot_diff(mid, sc.snapshot())


def state_group_compiler(native: bool) -> StepCompiler:
    """Full attention (block 4) and a Mamba state group (block 16 of max_model_len 32: a
    request may hold 2 state slots); A decodes (9 tokens held, 8 computed) with one state
    slot (id 1)."""
    from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
    from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec

    cfg = KVCacheConfig(32, (KVCacheGroupSpec(("attn",), FullAttentionSpec(block_size=4)),
                             KVCacheGroupSpec(("mamba",), MambaSpec(block_size=16))),
                        num_state_slots=8, state_slots_per_request=2)
    sc = StepCompiler(cfg, max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, validate=True, native=native)
    first = SchedulerOutput([NewRequestData("A", list(range(1, 9)), ([1, 2], [1]))], CachedRequestData(), {"A": 8})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens(["A"], [40])
    return sc


@pytest.mark.parametrize("native", PATHS)
def test_drafts_need_a_state_slot_per_draft_position_counting_this_steps_appends(native):
    """One draft needs 1 + 1 slots in the state group: A holds 1, so the step is refused
    (naming A and the field, state unchanged) on whichever path plans it (the compiled
    scan plans this regular step); with a second slot appended in the same output it is
    taken."""
    sc = state_group_compiler(native)
    before = sc.snapshot()

    def out(state_ids):
        cd = CachedRequestData(["A"], [False], [[]], [([3], state_ids)], [8])
        return SchedulerOutput([], cd, {"A": 2}, scheduled_spec_decode_tokens={"A": [5]})

    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(out([]))
    assert sc.checker.last_scanned is native  # both planning paths run the check
    assert (e.value.req_id, e.value.field) == ("A", "scheduled_spec_decode_tokens"), str(e.value)
    msg = str(e.value)
    assert msg.endswith("1 drafts need 1 + 1 state slots in state group 1 (the request's state and one per draft "
                        "position), the request holds 1: the state pool was sized for fewer drafts "
                        "(KVCacheConfig.state_slots_per_request)"), msg
    assert not snapshot_diff(before, sc.snapshot())
    so = out([2])
    sc.update_states(so)
    r = sc.input_batch.req_id_to_index["A"]
    assert sc.input_batch.block_table.num_blocks_per_row[1, r] == 2 and sc.input_batch.num_spec_tokens[r] == 1
    assert sc.prepare_inputs(so).input_ids.tolist() == [40, 5]


@pytest.mark.parametrize("native", PATHS)
def test_packed_drafts_count_the_state_slots_appended_in_the_packed_arrays(native):
    """The same step handed packed (``packed_cached``): the second state slot comes in the
    packed appends, which the state-slot check counts on whichever path plans the step
    (the compiled scan plans it itself)."""
    from test_packed_drafts_and_appends import packed

    sc = state_group_compiler(native)
    cd = CachedRequestData(["A"], [False], [[]], [([3], [2])], [8])
    so = packed(SchedulerOutput([], cd, {"A": 2}, scheduled_spec_decode_tokens={"A": [5]}))
    sc.update_states(so)
    assert sc.checker.last_scanned is native
    r = sc.input_batch.req_id_to_index["A"]
    assert sc.input_batch.block_table.num_blocks_per_row[:, r].tolist() == [3, 2]
    assert sc.input_batch.num_spec_tokens[r] == 1
    assert sc.prepare_inputs(so).input_ids.tolist() == [40, 5]


@pytest.mark.parametrize("native", PATHS)
def test_packed_drafts_short_of_state_slots_are_refused_under_the_packed_field(native):
    """The refusal above with the step handed packed: both paths name the field the caller
    sent, ``packed_cached.draft_token_ids`` (the compiled scan plans the step and checks the
    slots after it; the vectorized checks rename it), with the same words, nothing changed."""
    from test_packed_drafts_and_appends import packed

    sc = state_group_compiler(native)
    before = sc.snapshot()
    cd = CachedRequestData(["A"], [False], [[]], [([3], [])], [8])
    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(packed(SchedulerOutput([], cd, {"A": 2}, scheduled_spec_decode_tokens={"A": [5]})))
    assert sc.checker.last_scanned is native
    assert (e.value.req_id, e.value.field) == ("A", "packed_cached.draft_token_ids"), str(e.value)
    assert str(e.value).endswith("1 drafts need 1 + 1 state slots in state group 1 (the request's state and one per "
                                 "draft position), the request holds 1: the state pool was sized for fewer drafts "
                                 "(KVCacheConfig.state_slots_per_request)"), str(e.value)
    assert not snapshot_diff(before, sc.snapshot())
