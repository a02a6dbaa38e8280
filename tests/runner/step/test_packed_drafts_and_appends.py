"""Drafts and block appends handed packed (``SchedulerOutput.packed_cached``,
``PackedCachedDeltas``) give the same step as vLLM's form, byte for byte, on the compiled
and the numpy path (the compiled cached scan plans a regular packed step itself); bad
packed input raises ``InvalidSchedulerOutput`` naming the request and the packed field,
and changes nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.packed_deltas import pack_cached_deltas, unpack_cached_deltas
from attnplug.runner.step.scheduler_output import (
    CachedRequestData, NewRequestData, PackedCachedDeltas, SchedulerOutput)

PATHS = [pytest.param(False, id="numpy"),
         pytest.param(True, id="compiled", marks=pytest.mark.skipif(NATIVE is None, reason="not built"))]
I32 = np.int32


def packed(so: SchedulerOutput, num_groups: int = 2) -> SchedulerOutput:
    """``so`` with its drafts and appends packed (``so`` unchanged)."""
    cached, pk = pack_cached_deltas(so.scheduled_cached_reqs, so.scheduled_spec_decode_tokens, num_groups)
    return dataclasses.replace(so, scheduled_cached_reqs=cached, scheduled_spec_decode_tokens={},
                               num_scheduled_tokens=dict(so.num_scheduled_tokens), packed_cached=pk)


def make_compiler(native: bool) -> StepCompiler:
    """Two groups of block size 4; a, b, c decode (7, 8, 2 tokens held, one left each)."""
    sc = StepCompiler([4, 4], 4, 32, 32, num_blocks=32, native=native, validate=True)
    first = SchedulerOutput([NewRequestData("a", list(range(7)), ([1, 2], [11, 12]), 6),
                             NewRequestData("b", list(range(8)), ([3, 4], [13, 14]), 7),
                             NewRequestData("c", [5, 6], ([5], [15]), 1)], CachedRequestData(),
                            {"a": 1, "b": 1, "c": 1})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens(["a", "b", "c"], [7, 8, 9])
    return sc


def draft_step() -> SchedulerOutput:
    """a verifies 3 drafts and appends a block per group, b 1 draft and appends two blocks
    in group 0 (one more than it needs) and one in group 1, c none and no append (vLLM's form)."""
    cached = CachedRequestData(["a", "b", "c"], [False] * 3, [[], [], []],
                               [([7], [17]), ([6, 8], [18]), None], [7, 8, 2])
    return SchedulerOutput([], cached, {"a": 4, "b": 2, "c": 1},
                           scheduled_spec_decode_tokens={"a": [21, 22, 23], "b": [24]})


def run(native: bool, so: SchedulerOutput):
    sc = make_compiler(native)
    plan = sc.checker.plan(so)
    scanned = sc.checker.last_scanned
    sc.apply(plan)
    return sc, sc.prepare_inputs(so), scanned


def test_pack_and_unpack_are_inverse():
    so = draft_step()
    cached, pk = pack_cached_deltas(so.scheduled_cached_reqs, so.scheduled_spec_decode_tokens, 2)
    assert pk.num_draft_tokens.tolist() == [3, 1, 0] and pk.draft_token_ids.tolist() == [21, 22, 23, 24]
    assert pk.num_new_blocks.tolist() == [[1, 2, 0], [1, 1, 0]] and pk.new_block_ids.tolist() == [7, 6, 8, 17, 18]
    assert cached.new_block_ids == [None, None, None] and so.scheduled_cached_reqs.new_block_ids[0] == ([7], [17])
    spec, blocks = unpack_cached_deltas(cached.req_ids, cached.new_block_ids, pk)
    assert spec == so.scheduled_spec_decode_tokens
    assert blocks == [([7], [17]), ([6, 8], [18]), None]


@pytest.mark.parametrize("native", PATHS)
def test_a_packed_step_equals_the_vllm_form_byte_for_byte(native):
    ref, a, _ = run(native, draft_step())
    got, b, scanned = run(native, packed(draft_step()))
    assert scanned == bool(native)  # the compiled scan plans the packed step itself
    for name in ("input_ids", "positions", "seq_lens", "query_start_loc"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    for g in range(2):
        assert a.slot_mapping[g].tolist() == b.slot_mapping[g].tolist()
    assert b.input_ids.tolist() == [7, 21, 22, 23, 8, 24, 9]
    ma, mb = a.spec_decode_metadata, b.spec_decode_metadata
    assert ma.num_draft_tokens == mb.num_draft_tokens == [3, 1, 0]
    for name in ("draft_token_ids", "cu_num_draft_tokens", "target_logits_indices", "bonus_logits_indices"):
        assert getattr(ma, name).tolist() == getattr(mb, name).tolist(), name
    x, y = ref.input_batch, got.input_batch
    for name in ("token_ids_cpu", "num_tokens", "num_spec_tokens", "num_computed_tokens_cpu"):
        assert np.array_equal(getattr(x, name), getattr(y, name)), name
    assert np.array_equal(x.block_table.num_blocks_per_row, y.block_table.num_blocks_per_row)
    assert np.array_equal(x.block_table.block_id_bound, y.block_table.block_id_bound)
    for rid in "abc":
        assert [list(b) for b in ref.requests[rid].block_ids] == [list(b) for b in got.requests[rid].block_ids]
    r = got.input_batch.req_id_to_index
    bt0, bt1 = (got.input_batch.block_table[g].block_table_np for g in range(2))
    assert bt0[r["a"], :3].tolist() == [1, 2, 7] and bt1[r["a"], :3].tolist() == [11, 12, 17]
    assert bt0[r["b"], :4].tolist() == [3, 4, 6, 8] and bt1[r["b"], :4].tolist() == [13, 14, 18, 0]


def _with(so: SchedulerOutput, **arrays) -> SchedulerOutput:
    so.packed_cached = dataclasses.replace(so.packed_cached, **arrays)
    return so


def _bad_cases():
    """``(name, make the output, request named, field, words of the message)``."""
    P = lambda: packed(draft_step())  # noqa: E731
    F = "packed_cached."
    return [
        ("int64 counts", lambda: _with(P(), num_draft_tokens=np.array([3, 1, 0])), None, F + "num_draft_tokens",
         "expected a C-contiguous 1-D int32 array, got 1-D int64"),
        ("a list of ids", lambda: _with(P(), draft_token_ids=[21, 22, 23, 24]), None, F + "draft_token_ids",
         "got [21, 22, 23, 24]"),
        ("strided ids", lambda: _with(P(), new_block_ids=np.array([7, 0, 6, 0, 8, 0, 17, 0, 18, 0], I32)[::2]), None,
         F + "new_block_ids", "(not contiguous)"),
        ("1-D block counts", lambda: _with(P(), num_new_blocks=np.array([1, 2, 0], I32)), None,
         F + "num_new_blocks", "2-D int32"),
        ("short counts", lambda: _with(P(), num_draft_tokens=np.array([3, 1], I32)), None, F + "num_draft_tokens",
         "has 2 entries for 3 cached requests"),
        ("one group", lambda: _with(P(), num_new_blocks=np.array([[1, 2, 0]], I32),
                                    new_block_ids=np.array([7, 6, 8], I32)), None, F + "num_new_blocks",
         "has 1 rows for 2 cache groups"),
        ("block counts for two requests", lambda: _with(P(), num_new_blocks=np.array([[1, 2], [1, 1]], I32)), None,
         F + "num_new_blocks", "has 2 columns for 3 cached requests"),
        ("negative count", lambda: _with(P(), num_draft_tokens=np.array([3, -1, 2], I32)), "b",
         F + "num_draft_tokens", "counts must be >= 0"),
        ("negative block count in group 1", lambda: _with(P(), num_new_blocks=np.array([[1, 2, 0], [1, 1, -1]], I32)),
         "c", F + "num_new_blocks", "counts must be >= 0"),
        ("counts past the ids", lambda: _with(P(), num_draft_tokens=np.array([3, 2, 0], I32)), None,
         F + "num_draft_tokens", "counts sum to 5, but packed_cached.draft_token_ids holds 4"),
        ("drafts in both forms", lambda: dataclasses.replace(P(), scheduled_spec_decode_tokens={"a": [1]}), None,
         "scheduled_spec_decode_tokens", "must be empty when packed_cached carries the drafts"),
        ("appends in both forms", lambda: _lists_too(P()), "c", "new_block_ids",
         "must be None when packed_cached carries the appends"),
        ("negative draft", lambda: _with(P(), draft_token_ids=np.array([21, -22, 23, 24], I32)), "a",
         F + "draft_token_ids", "draft token ids must be ints in [0, 2**31)"),
        ("drafts for a prefilling row", lambda: _prefilling(P()), "c", F + "draft_token_ids",
         "2 drafts need num_scheduled_tokens == 1 + 2, got 1"),
        ("drafts for a row with two tokens left", _two_left, "c", F + "draft_token_ids",
         "row still prefilling: 2 real tokens left to compute"),
        ("block past the pool", lambda: _with(P(), new_block_ids=np.array([7, 6, 8, 99, 18], I32)), "a",
         F + "new_block_ids", "99"),
        ("block held twice", lambda: _with(P(), new_block_ids=np.array([7, 6, 6, 17, 18], I32)), "b",
         F + "new_block_ids", ""),
        ("packed appends of a resumed request", lambda: _resumed(P()), "b", F + "num_new_blocks",
         "a resumed request's blocks replace its own: send them in scheduled_cached_reqs.new_block_ids, with 0 here"),
        ("not the type", lambda: dataclasses.replace(P(), packed_cached=(1, 2, 3, 4)), None, "packed_cached",
         "expected PackedCachedDeltas or None, got tuple"),
    ]


def _lists_too(so: SchedulerOutput) -> SchedulerOutput:
    so.scheduled_cached_reqs.new_block_ids[2] = ([9], [19])
    return so


def _resumed(so: SchedulerOutput) -> SchedulerOutput:
    """b resumed from preemption with its replacement lists, but its appends still packed."""
    so.scheduled_cached_reqs.resumed_from_preemption[1] = True
    so.scheduled_cached_reqs.new_block_ids[1] = ([3, 4, 6], [13, 14])
    return so


def _two_left() -> SchedulerOutput:
    """c rolled back to 1 of its 3 tokens computed, scheduled 1 + 1 with one draft."""
    so = packed(draft_step())
    so.scheduled_cached_reqs.num_computed_tokens[2] = 1
    so.num_scheduled_tokens["c"] = 2
    so.total_num_scheduled_tokens += 1
    return _with(so, num_draft_tokens=np.array([3, 1, 1], I32), draft_token_ids=np.array([21, 22, 23, 24, 30], I32))


def _prefilling(so: SchedulerOutput) -> SchedulerOutput:
    return _with(so, num_draft_tokens=np.array([3, 1, 2], I32), draft_token_ids=np.array([21, 22, 23, 24, 1, 2], I32))


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name, make, rid, field, words", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_packed_input_names_request_and_field_and_changes_nothing(native, name, make, rid, field, words):
    sc = make_compiler(native)
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(make())
    assert (e.value.req_id, e.value.field) == (rid, field), str(e.value)
    assert words in str(e.value), str(e.value)
    assert not snapshot_diff(before, sc.snapshot())
    so = packed(draft_step())  # and the state still takes a valid packed step
    sc.update_states(so)
    assert sc.prepare_inputs(so).input_ids.tolist() == [7, 21, 22, 23, 8, 24, 9]


def test_the_dataclass_is_data_only():
    fields = [f.name for f in dataclasses.fields(PackedCachedDeltas)]
    assert fields == ["num_draft_tokens", "draft_token_ids", "num_new_blocks", "new_block_ids"]
    assert [f.name for f in dataclasses.fields(SchedulerOutput)][-1] == "packed_cached"


def test_the_bench_hands_the_same_steps_in_both_forms():
    """``attnplug bench step --spec-form packed`` times the same steps as ``--spec-form vllm``."""
    from attnplug.runner.commands.bench.spec_decode import spec_decode_workload
    from attnplug.runner.step.packed_deltas import as_vllm_form

    for k in (3, 0):
        _, vllm, _ = spec_decode_workload(8, 40, k, form="vllm")
        _, pk, _ = spec_decode_workload(8, 40, k, form="packed")
        assert sum(s.packed_cached is not None and bool(s.packed_cached.num_new_blocks.any()) for s in pk) > 5
        assert [as_vllm_form(s) for s in pk] == vllm
