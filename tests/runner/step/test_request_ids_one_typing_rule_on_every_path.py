"""Request ids follow one typing rule wherever a step takes them (``check.types.request_id``):
a ``str`` or a ``str`` subclass such as ``numpy.str_`` (an id read out of a numpy array), looked
up by its value; anything else is ``InvalidSchedulerOutput`` naming the field, and changes
nothing. New requests, cached requests (in the batch and re-added), the keys of
``num_scheduled_tokens`` and ``scheduled_spec_decode_tokens``, ``finished_req_ids``,
``PackedCachedDeltas`` (aligned with the cached ids) and stage 8's ids; both kernel paths.
The runner keeps a new request's id as a plain ``str``."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.scheduler_output import (CachedRequestData, NewRequestData, PackedCachedDeltas,
                                                   SchedulerOutput)

PATHS = [None, False] if kernels_available() else [False]
S = np.str_


def compiler(native) -> StepCompiler:
    return StepCompiler([4], max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64, native=native,
                        validate=True)


def two_sampled(native) -> StepCompiler:
    """a (5 tokens) and b (3 tokens) prefilled and sampled."""
    sc = compiler(native)
    first = SchedulerOutput([NewRequestData("a", [1, 2, 3, 4, 5], ([1, 2],)), NewRequestData("b", [6, 7, 8], ([3, 6],))],
                            CachedRequestData(), {"a": 5, "b": 3})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens([0, 1], [100, 101])
    return sc


def decode(ids: list, nst_keys: list | None = None, **kw) -> SchedulerOutput:
    """a and/or b decode one token (a at 5 computed, b at 3)."""
    ncc = {"a": 5, "b": 3}
    cached = CachedRequestData(list(ids), [False] * len(ids), [[] for _ in ids], [None] * len(ids),
                               [ncc[str(r)] for r in ids])
    keys = ids if nst_keys is None else nst_keys
    return SchedulerOutput([], cached, {k: 1 for k in keys}, **kw)


def refused_unchanged(sc: StepCompiler, field: str, match: str, so: SchedulerOutput) -> None:
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput, match=match) as e:
        sc.update_states(so)
    assert e.value.field == field
    assert not snapshot_diff(before, sc.snapshot())


@pytest.mark.parametrize("native", PATHS)
def test_a_new_request_id_may_be_a_str_subclass_and_is_kept_as_str(native):
    sc = compiler(native)
    so = SchedulerOutput([NewRequestData(S("a"), [1, 2, 3], ([1],))], CachedRequestData(), {"a": 3})
    sc.update_states(so)
    inputs = sc.prepare_inputs(so)
    assert inputs.req_ids == ["a"] and type(inputs.req_ids[0]) is str
    assert [type(r) for r in sc.requests] == [str]
    assert [type(r) for r in sc.input_batch.req_id_to_index] == [str]


@pytest.mark.parametrize("native", PATHS)
def test_cached_ids_nst_keys_and_finished_ids_may_be_str_subclasses(native):
    sc = two_sampled(native)
    sc.update_states(decode([S("a"), "b"], nst_keys=["a", S("b")]))
    assert sc.prepare_inputs().input_ids.tolist() == [100, 101]
    sc.append_output_tokens([S("a"), "b"], [102, 103])
    sc.update_states(SchedulerOutput([], CachedRequestData(["b"], [False], [[]], [None], [4]), {"b": 1},
                                     finished_req_ids={S("a")}))
    assert list(sc.requests) == ["b"] and sc.input_batch.req_ids == ["b"]


@pytest.mark.parametrize("native", PATHS)
def test_a_readded_cached_id_may_be_a_str_subclass(native):
    """A resident request that left the batch (unscheduled) comes back under a ``numpy.str_`` id."""
    sc = two_sampled(native)
    sc.update_states(decode(["b"]))  # a unscheduled: it leaves the batch, keeps its state
    sc.prepare_inputs()
    sc.append_output_tokens(["b"], [103])
    cached = CachedRequestData([S("a")], [False], [[]], [None], [5])
    sc.update_states(SchedulerOutput([], cached, {"a": 1}))
    inputs = sc.prepare_inputs()
    assert inputs.req_ids == ["a"] and type(inputs.req_ids[0]) is str
    assert inputs.input_ids.tolist() == [100]


@pytest.mark.parametrize("native", PATHS)
def test_packed_deltas_follow_str_subclass_cached_ids(native):
    sc = two_sampled(native)
    pk = PackedCachedDeltas(np.array([0, 0], np.int32), np.zeros(0, np.int32), np.array([[0, 1]], np.int32),
                            np.array([7], np.int32))
    sc.update_states(decode([S("a"), S("b")], packed_cached=pk))
    assert sc.requests["b"].block_ids[0] == [3, 6, 7]


BAD_IDS = {"bytes": b"a", "int": 7, "None": None}


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", list(BAD_IDS))
def test_a_new_request_id_that_is_not_a_str_is_refused(native, name):
    sc = two_sampled(native)
    bad = BAD_IDS[name]
    so = SchedulerOutput([NewRequestData(bad, [1, 2], ([4],))], CachedRequestData(), {bad: 2})
    refused_unchanged(sc, "scheduled_new_reqs", "request ids must be str, got", so)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", list(BAD_IDS))
def test_a_cached_id_that_is_not_a_str_is_refused(native, name):
    """A non-str id that is not in the batch (the lookup misses) names the field, not 'unknown'."""
    sc = two_sampled(native)
    bad = BAD_IDS[name]
    cached = CachedRequestData(["a", bad], [False] * 2, [[], []], [None] * 2, [5, 3])
    refused_unchanged(sc, "scheduled_cached_reqs.req_ids", "request ids must be str, got",
                      SchedulerOutput([], cached, {"a": 1, bad: 1}))


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", list(BAD_IDS))
def test_a_finished_id_that_is_not_a_str_is_refused(native, name):
    sc = two_sampled(native)
    refused_unchanged(sc, "finished_req_ids", "request ids must be str, got",
                      decode(["a", "b"], finished_req_ids={BAD_IDS[name]}))


@pytest.mark.parametrize("native", PATHS)
def test_an_unknown_str_subclass_finished_id_is_unknown_not_mistyped(native):
    sc = two_sampled(native)
    refused_unchanged(sc, "finished_req_ids", "unknown request", decode(["a", "b"], finished_req_ids={S("zz")}))
