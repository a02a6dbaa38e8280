"""Asynchronous steps and stage 8 with bad input: the project's error, nothing changed, both
kernel paths alike (the rule of docs/architecture.md: validate first, then mutate).

``prepare_inputs(prev_token_ids=...)`` takes a 1-D integer tensor whose entries are token ids,
one per placeholder of the latest ``append_placeholders`` (neither shorter nor longer);
a placeholder that neither ``prev_token_ids`` nor ``fill_output_tokens`` replaced never reaches
``input_ids`` silently (a second patched prepare of one step, a prepare without the tokens);
``fill_output_tokens``, ``append_output_tokens`` and ``append_verified_tokens`` take token ids by
stage 8's one typing rule (``append.token_id_array``: lists/tuples of ints or 1-D integer numpy
arrays, never a tensor or a bool of any kind) and write nothing when any entry is bad; their
rows are a list of ints or a 1-D integer array, never flattened."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import MetadataError
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

PATHS = [None, False] if kernels_available() else [False]
SAMPLED = [70, 71, 72]


def _decode(ncc: tuple[int, ...]) -> SchedulerOutput:
    cached = CachedRequestData(list("abc"), [False] * 3, [[], [], []], [None] * 3, list(ncc))
    return SchedulerOutput([], cached, dict.fromkeys("abc", 1))


def sampled(native) -> StepCompiler:
    """a, b, c prefilled (5, 3, 6 tokens) and sampled (100, 101, 102)."""
    sc = StepCompiler([4], max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64, native=native,
                      validate=True)
    first = SchedulerOutput([NewRequestData("a", [1, 2, 3, 4, 5], ([1, 2],)), NewRequestData("b", [6, 7, 8], ([3, 6],)),
                             NewRequestData("c", [9, 10, 11, 12, 13, 14], ([4, 5],))], CachedRequestData(),
                            {"a": 5, "b": 3, "c": 6})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens([0, 1, 2], [100, 101, 102])
    return sc


def async_step(native) -> tuple[StepCompiler, SchedulerOutput, object]:
    """:func:`sampled`, then one decode step whose tokens stay on the device (placeholders);
    the next step applied, not yet prepared."""
    sc = sampled(native)
    decode = _decode((5, 3, 6))
    sc.update_states(decode)
    sc.prepare_inputs(decode)
    ph = sc.append_placeholders([0, 1, 2])
    nxt = _decode((6, 4, 7))
    sc.update_states(nxt)
    return sc, nxt, ph


def refused_unchanged(sc: StepCompiler, match: str, call) -> None:
    """``call()`` raises ``MetadataError`` matching ``match`` and changes no state."""
    before = sc.snapshot()
    with pytest.raises(MetadataError, match=match):
        call()
    assert not snapshot_diff(before, sc.snapshot())


BAD_PREV = {
    "2-D": torch.tensor([SAMPLED]),
    "0-d": torch.tensor(70),
    "numpy": np.array(SAMPLED),
    "list": list(SAMPLED),
    "float": torch.tensor([70.0, 71.0, 72.0]),
    "bool": torch.tensor([True, False, True]),
    "short int64": torch.tensor(SAMPLED[:2]),
    "short int32": torch.tensor(SAMPLED[:2], dtype=torch.int32),
    "empty": torch.zeros(0, dtype=torch.int64),
    "negative": torch.tensor([-5, 71, 72]),
    "past int32": torch.tensor([2**40, 71, 72]),
    "past int32, strided": torch.tensor([2**40, 0, 71, 0, 72, 0])[::2],
    "longer": torch.tensor(SAMPLED + [73]),
    "longer int32": torch.tensor(SAMPLED + [73], dtype=torch.int32),
    "one per batch row, padded": torch.tensor(SAMPLED + [0] * 5),
    "no memory (a zero tensor)": torch._efficientzerotensor(len(SAMPLED), dtype=torch.int64),
}


def _freed() -> torch.Tensor:
    t = torch.tensor(SAMPLED)
    t.untyped_storage().resize_(0)  # elements but no memory: read as garbage before
    return t


BAD_PREV["no memory (storage resized to nothing)"] = _freed()


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", list(BAD_PREV))
def test_bad_prev_token_ids_are_refused_and_the_retry_patches(native, name):
    sc, nxt, _ = async_step(native)  # (unchanged: prev_sampled_index not consumed)
    refused_unchanged(sc, "prepare_inputs: prev_token_ids",
                      lambda: sc.prepare_inputs(nxt, prev_token_ids=BAD_PREV[name]))
    assert sc.prepare_inputs(nxt, prev_token_ids=torch.tensor(SAMPLED)).input_ids.tolist() == SAMPLED


@pytest.mark.parametrize("native", PATHS)
def test_prev_token_ids_hold_one_token_per_placeholder_of_the_latest_append(native):
    """The count is the sampled tensor's (the latest ``append_placeholders``), not the rows
    still waiting: b finished meanwhile and a and c still take entries 0 and 2; a tensor
    with a token per remaining row (2) is refused, as a longer one is."""
    sc = sampled(native)
    decode = _decode((5, 3, 6))
    sc.update_states(decode)
    sc.prepare_inputs(decode)
    sc.append_placeholders([0, 1, 2])
    cached = CachedRequestData(["a", "c"], [False] * 2, [[], []], [None] * 2, [6, 7])
    nxt = SchedulerOutput([], cached, {"a": 1, "c": 1}, finished_req_ids={"b"})
    sc.update_states(nxt)
    refused_unchanged(sc, "prev_token_ids holds 2 tokens but the latest append_placeholders appended 3 "
                          "placeholders: pass that step's sampled tensor, one token per sampling row in the "
                          "order append_placeholders got$",
                      lambda: sc.prepare_inputs(nxt, prev_token_ids=torch.tensor([70, 72])))
    assert sc.prepare_inputs(nxt, prev_token_ids=torch.tensor(SAMPLED)).input_ids.tolist() == [70, 72]


@pytest.mark.parametrize("native", PATHS)
def test_prev_token_ids_without_placeholders_must_be_empty(native):
    """No ``append_placeholders`` yet: the count is 0 (a synchronous step's tokens are not
    a sampled tensor to patch from)."""
    sc = sampled(native)
    decode = _decode((5, 3, 6))
    sc.update_states(decode)
    refused_unchanged(sc, "prev_token_ids holds 3 tokens but the latest append_placeholders appended 0",
                      lambda: sc.prepare_inputs(decode, prev_token_ids=torch.tensor(SAMPLED)))
    assert sc.prepare_inputs(decode, prev_token_ids=torch.zeros(0, dtype=torch.int64)).input_ids.tolist() == \
        [100, 101, 102]


@pytest.mark.parametrize("native", PATHS)
def test_other_integer_dtypes_and_strides_patch_like_int64(native):
    sc, nxt, _ = async_step(native)
    prev = torch.tensor([70, 0, 71, 0, 72, 0], dtype=torch.int16)[::2]
    assert sc.prepare_inputs(nxt, prev_token_ids=prev).input_ids.tolist() == SAMPLED


@pytest.mark.parametrize("native", PATHS)
def test_a_placeholder_never_reaches_input_ids(native):
    """A second patched prepare of one step (the first consumed the columns), and a prepare
    without the tokens, are refused naming the request; once filled, the history serves."""
    sc, nxt, ph = async_step(native)
    refused_unchanged(sc, "request 'a': its token at position 6 is a placeholder", lambda: sc.prepare_inputs(nxt))
    assert sc.prepare_inputs(nxt, prev_token_ids=torch.tensor(SAMPLED)).input_ids.tolist() == SAMPLED
    with pytest.raises(MetadataError, match="is a placeholder whose sampled token was neither given nor filled"):
        sc.prepare_inputs(nxt, prev_token_ids=torch.tensor(SAMPLED))
    assert sc.fill_output_tokens(ph, SAMPLED) == 3
    assert sc.prepare_inputs(nxt).input_ids.tolist() == SAMPLED  # filled: read from the history


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("drafts", [{"a": [7, 8], "b": [7, 8], "c": [7, 8]}, {"a": [7, 8], "b": [7]}],
                         ids=["equal widths", "mixed widths"])
def test_a_placeholder_never_reaches_input_ids_on_a_step_with_drafts(native, drafts):
    """The same on a step whose rows verify drafts (rows of several tokens: the compiled
    gather copies them row by row, equal widths compiled apart); patched, the drafts follow
    the sampled tokens."""
    sc = sampled(native)
    decode = _decode((5, 3, 6))
    sc.update_states(decode)
    sc.prepare_inputs(decode)
    sc.append_placeholders([0, 1, 2])
    counts = {r: 1 + len(drafts.get(r, [])) for r in "abc"}
    ncc = [6, 4, 7]  # each row holds two blocks of 4: a third where the drafts need one
    blocks = [([20 + i],) if c + counts[r] > 8 else None for i, (r, c) in enumerate(zip("abc", ncc))]
    nxt = SchedulerOutput([], CachedRequestData(list("abc"), [False] * 3, [[], [], []], blocks, ncc), counts,
                          scheduled_spec_decode_tokens=drafts)
    sc.update_states(nxt)
    refused_unchanged(sc, "request 'a': its token at position 6 is a placeholder", lambda: sc.prepare_inputs(nxt))
    expect = [t for r, s in zip("abc", SAMPLED) for t in [s] + drafts.get(r, [])]
    assert sc.prepare_inputs(nxt, prev_token_ids=torch.tensor(SAMPLED)).input_ids.tolist() == expect


BAD_TOKENS = {
    "negative last": [70, 71, -1],
    "None": [None, 71, 72],
    "2-D": np.array([[70], [71], [72]]),
    "float": [70.5, 71, 72],
    "str": [70, "71", 72],
    "bool": [70, True, 72],
    "float array": np.array([70.0, 71.0, 72.0]),
    "tensor": torch.tensor(SAMPLED),
    "bool tensor": torch.tensor([True, False, True]),
    "[n, 1] tensor": torch.tensor([[70], [71], [72]]),
    "a bool tensor entry": [70, torch.tensor(True), 72],
    "bytes": bytes(SAMPLED),
    "range": range(70, 73),
    "set": set(SAMPLED),
}


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", list(BAD_TOKENS))
def test_fill_output_tokens_refuses_bad_tokens_and_writes_none(native, name):
    sc, nxt, ph = async_step(native)
    refused_unchanged(sc, "fill_output_tokens: token ids must be ints",
                      lambda: sc.fill_output_tokens(ph, BAD_TOKENS[name]))
    assert sc.fill_output_tokens(ph, SAMPLED) == 3  # every placeholder still there


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", [n for n in BAD_TOKENS if n != "2-D"])  # (2-D: a token list per request there)
def test_append_output_tokens_refuses_the_same_bad_tokens_and_writes_none(native, name):
    sc = sampled(native)
    decode = _decode((5, 3, 6))
    sc.update_states(decode)
    sc.prepare_inputs(decode)
    refused_unchanged(sc, "append_output_tokens: token ids must be ints",
                      lambda: sc.append_output_tokens([0, 1, 2], BAD_TOKENS[name]))
    sc.append_output_tokens([0, 1, 2], SAMPLED)


GOOD_TOKENS = {
    "numpy ints": [np.int32(70), np.int64(71), np.uint8(72)],
    "a 0-d integer array first": [np.array(70), 71, 72],
    "tuple": tuple(SAMPLED),
    "int32 array": np.array(SAMPLED, dtype=np.int32),
}


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", list(GOOD_TOKENS))
def test_fill_and_append_take_the_same_integer_forms(native, name):
    sc, _, ph = async_step(native)
    assert sc.fill_output_tokens(ph, GOOD_TOKENS[name]) == 3
    b = sc.input_batch
    filled = [b.token_ids_cpu[b.req_id_to_index[rid], pos] for rid, pos in zip(ph.req_ids, ph.positions.tolist())]
    sc = sampled(native)
    decode = _decode((5, 3, 6))
    sc.update_states(decode)
    sc.prepare_inputs(decode)
    sc.append_output_tokens([0, 1, 2], GOOD_TOKENS[name])
    b = sc.input_batch
    assert [b.token_ids_cpu[r, b.num_tokens[r] - 1] for r in range(3)] == filled == SAMPLED


@pytest.mark.parametrize("native", PATHS)
def test_fill_output_tokens_checks_every_placeholder_before_writing(native):
    """The per-request loop (a request detached from the batch) finds a placeholder gone
    only after others: nothing is written."""
    sc, nxt, ph = async_step(native)
    b = sc.input_batch
    b.token_ids_cpu[b.req_id_to_index["c"], 7] = 5  # c's placeholder is gone (as if filled)
    sc.input_batch.remove_requests(["a"])  # a detached: the loop, not the scatter
    refused_unchanged(sc, "request 'c' has no placeholder at position 7", lambda: sc.fill_output_tokens(ph, SAMPLED))


@pytest.mark.parametrize("native", PATHS)
def test_fill_output_tokens_refuses_a_placeholder_past_a_detached_history(native):
    """a finished after its placeholder (position 6) and came back under the same id with a
    6-token prompt, now resident but unscheduled: its history ends before position 6, so
    the placeholder is not there (refused, nothing written; b's is not filled either)."""
    sc = sampled(native)
    decode = _decode((5, 3, 6))
    sc.update_states(decode)
    sc.prepare_inputs(decode)
    ph = sc.append_placeholders([0, 1, 2])
    cached = CachedRequestData(["b", "c"], [False] * 2, [[], []], [None] * 2, [4, 7])
    sc.update_states(SchedulerOutput([NewRequestData("a", [1, 2, 3, 4, 5, 6], ([7, 8],))], cached,
                                     {"a": 6, "b": 1, "c": 1}, finished_req_ids={"a"}))
    sc.update_states(SchedulerOutput([], cached, {"b": 1, "c": 1}))  # a: resident, out of the batch
    assert sc.requests["a"].row is None and ph.positions.tolist()[0] == 6
    refused_unchanged(sc, "fill_output_tokens: request 'a' has no placeholder at position 6$",
                      lambda: sc.fill_output_tokens(ph, SAMPLED))

@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("bad", [[[7.9, 50], [1], [52]], [[7, "50"], [1], [52]], [[7, 8], [True], [52]]])
def test_append_verified_tokens_refuses_non_int_tokens(native, bad):
    sc = sampled(native)
    cached = CachedRequestData(list("abc"), [False] * 3, [[], [], []], [None] * 3, [5, 3, 6])
    so = SchedulerOutput([], cached, {"a": 3, "b": 1, "c": 1}, scheduled_spec_decode_tokens={"a": [7, 8]})
    sc.update_states(so)
    sc.prepare_inputs(so)
    refused_unchanged(sc, "append_verified_tokens: token ids must be ints",
                      lambda: sc.append_verified_tokens([0, 1, 2], bad))


@pytest.mark.parametrize("native", PATHS)
def test_a_str_subclass_draft_key_is_taken_on_both_paths(native):
    """``numpy.str_`` ids are taken in ``req_ids``; the drafts' keys follow the same rule."""
    sc = StepCompiler([4], max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64, native=native)
    first = SchedulerOutput([NewRequestData("a", [1, 2, 3, 4, 5], ([1, 2],))], CachedRequestData(), {"a": 5})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens([0], [100])
    so = SchedulerOutput([], CachedRequestData(["a"], [False], [[]], [None], [5]), {"a": 3},
                         scheduled_spec_decode_tokens={np.str_("a"): [7, 8]})
    sc.update_states(so)
    md = sc.prepare_inputs(so).spec_decode_metadata
    assert md.draft_token_ids.tolist() == [7, 8]


@pytest.mark.parametrize("native", PATHS)
def test_drafts_on_rows_whose_last_token_is_a_placeholder_are_patched(native):
    """The step compiler does not refuse drafts in an asynchronous step (the engine does):
    the placeholder is patched, the drafts follow it, and stage 8 then fills and verifies."""
    sc, _, ph = async_step(native)
    cached = CachedRequestData(list("abc"), [False] * 3, [[], [], []], [([7],), None, ([8],)], [6, 4, 7])
    so = SchedulerOutput([], cached, {"a": 3, "b": 1, "c": 2}, scheduled_spec_decode_tokens={"a": [9, 9], "c": [8]})
    sc.update_states(so)
    inputs = sc.prepare_inputs(so, prev_token_ids=torch.tensor(SAMPLED))
    assert inputs.input_ids[:inputs.num_actual_tokens].tolist() == [70, 9, 9, 71, 72, 8]
    assert inputs.spec_decode_metadata.draft_token_ids.tolist() == [9, 9, 8]
    assert sc.fill_output_tokens(ph, SAMPLED) == 3
    sc.append_verified_tokens([0, 1, 2], [[9, 9, 5], [6], [7]])
    b = sc.input_batch
    assert [b.token_ids_cpu[r, b.num_tokens[r] - 2:b.num_tokens[r]].tolist() for r in range(3)] == \
        [[9, 5], [71, 6], [72, 7]]


BAD_ROWS = {
    "2-D": np.array([[0, 1, 2]]),
    "column": np.array([[0], [1], [2]]),
    "list of lists": [[0], [1], [2]],
    "ragged": [[0], [1, 2]],
    "empty 2-D": np.zeros((0, 3), dtype=np.int64),
    "scalar": 0,
    "0-d": np.array(0),
    "tensor": torch.tensor([0, 1, 2]),
}
STAGE8 = {"append_placeholders": (), "append_output_tokens": ([5, 6, 7],),
          "append_verified_tokens": ([[5], [6], [7]],)}


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("call", list(STAGE8))
@pytest.mark.parametrize("name", list(BAD_ROWS))
def test_stage8_rows_are_a_list_or_a_1d_integer_array_never_flattened(native, call, name):
    """numpy would flatten a 2-D ``rows`` (or a list of one-row lists) into rows: refused,
    like a scalar or a tensor, on every stage-8 call; a 1-D array then appends."""
    sc = sampled(native)
    decode = _decode((5, 3, 6))
    sc.update_states(decode)
    sc.prepare_inputs(decode)
    refused_unchanged(sc, f"{call}: rows must be ints, as a list or a 1-D integer array",
                      lambda: getattr(sc, call)(BAD_ROWS[name], *STAGE8[call]))
    getattr(sc, call)(np.array([0, 1, 2]), *STAGE8[call])
    assert sc.input_batch.num_tokens[:3].tolist() == [7, 5, 8]
