"""The compiled fast paths (``runner/step/fast/_native.pyx``) against the numpy paths.

The contract: a fast path handles an input completely or declines it and changes
nothing; the numpy path then accepts it or words the error. So on every input below the
compiled and the numpy step compilers end in the same state, or raise the same
``InvalidSchedulerOutput`` (request id and field) and leave the state unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.int_packer import IntPacker
from attnplug.runner.step.kernels import choose_kernels
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff

pytestmark = pytest.mark.skipif(NATIVE is None, reason="the compiled extension is not built")

# group 0: full attention, block 4; group 1: full attention, block 8 with 4-token kernel blocks
KW = dict(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, kernel_block_sizes=[4, 4],
          num_blocks=[20, 10], validate=True)


def make(native: bool) -> StepCompiler:
    """A (6 tokens, 2+1 blocks) and B (3 tokens, 1+1 blocks) decoding; C unscheduled."""
    sc = StepCompiler([4, 8], native=native, **KW)
    sc.update_states(SchedulerOutput([
        NewRequestData("A", [1, 2, 3, 4, 5, 6], ([1, 2], [1])),
        NewRequestData("B", [7, 8, 9], ([3], [2])),
        NewRequestData("C", [10, 11], ([4], [3]))], CachedRequestData(), {"A": 6, "B": 3, "C": 2}))
    sc.prepare_inputs()
    sc.append_output_tokens(["A", "B", "C"], [60, 70, 80])
    sc.update_states(SchedulerOutput([], CachedRequestData(
        ["A", "B"], [False, False], [[], []], [None, None], [6, 3]), {"A": 1, "B": 1}))
    sc.prepare_inputs()
    sc.append_output_tokens(["A", "B"], [61, 71])
    return sc


def regular_step(**change) -> SchedulerOutput:
    """A and B decode one token each (B crosses into a new block of group 0, A gets one
    ahead of need); a new D."""
    c = dict(req_ids=["A", "B"], resumed=[False, False], tokens=[[], []], blocks=[([5], []), ([7], [])],
             ncts=[7, 4], nst={"A": 1, "B": 1, "D": 2}, finished=set(), new_ids=[9, 9, 9], new_blocks=([6], [4]),
             new_ncts=0, new_outs=[], sp=SamplingParams())
    c.update(change)
    return SchedulerOutput(
        [NewRequestData("D", c["new_ids"], c["new_blocks"], c["new_ncts"], c["sp"], c["new_outs"])],
        CachedRequestData(c["req_ids"], c["resumed"], c["tokens"], c["blocks"], c["ncts"]),
        c["nst"], finished_req_ids=c["finished"])


def test_a_regular_step_takes_the_compiled_path_and_matches_numpy():
    fast, slow = make(True), make(False)
    so = regular_step()
    plan = fast.checker.plan(so)
    assert fast.checker.last_scanned and plan.staged_new is not None and not plan.new_states  # NewScan staged D
    slow.checker.plan(so)
    assert not slow.checker.last_scanned
    for sc in (fast, slow):
        sc.update_states(so)
    a, b = fast.prepare_inputs(so), slow.prepare_inputs(so)
    assert a.req_ids == b.req_ids == ["A", "B", "D"]
    for name in ("query_start_loc", "positions", "input_ids", "seq_lens", "logits_indices"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert (a.discard == b.discard).all() and (a.is_prefilling == b.is_prefilling).all()
    for inputs in (a, b):  # the mask as documented: an array, and the same memory as a tensor
        assert type(inputs.is_prefilling) is np.ndarray and type(inputs.is_prefilling_cpu) is torch.Tensor
        assert inputs.is_prefilling_cpu.tolist() == inputs.is_prefilling.tolist()
    assert fast._preparer.kernels is fast.kernels and fast.kernels.name == "compiled"  # stage 3 on the compiled kernels
    for g in range(2):
        assert a.slot_mapping[g].tolist() == b.slot_mapping[g].tolist()
        assert a.block_table_tensor[g].tolist() == b.block_table_tensor[g].tolist()
    assert fast.requests["A"].block_ids == slow.requests["A"].block_ids == ([1, 2, 5], [1])
    assert fast.requests["B"].block_ids == slow.requests["B"].block_ids == ([3, 7], [2])
    assert a.slot_mapping[0].tolist()[:2] == [2 * 4 + 3, 7 * 4 + 0]  # A at 7, B at 4


BAD = [  # (change to the regular step, request id, field)
    (dict(req_ids=["A", "X"], nst={"A": 1, "X": 1, "D": 2}), "X", "scheduled_cached_reqs"),
    (dict(req_ids=["A", "A"], nst={"A": 1, "D": 2}), "A", "scheduled_cached_reqs"),  # listed twice
    (dict(ncts=[-1, 4]), "A", "num_computed_tokens"),
    (dict(ncts=[7.0, 4]), "A", "num_computed_tokens"),
    (dict(ncts=[True, 4]), None, None),  # declined by the scan; numpy reads True as 1
    (dict(nst={"A": 0, "B": 1, "D": 2}), "A", "num_scheduled_tokens"),
    (dict(nst={"A": 1.0, "B": 1, "D": 2}), "A", "num_scheduled_tokens"),
    (dict(nst={"A": 2, "B": 1, "D": 2}), "A", "num_scheduled_tokens"),  # seq 9 > 8 held
    (dict(nst={"A": 1, "D": 2}), "B", "num_scheduled_tokens"),
    (dict(blocks=[([20], []), ([7], [])]), "A", "new_block_ids"),  # outside group 0's pool
    (dict(blocks=[([0], []), ([7], [])]), "A", "new_block_ids"),  # the null block
    (dict(blocks=[([5], [10]), ([7], [])]), "A", "new_block_ids"),  # outside group 1's pool
    (dict(blocks=[([5.0], []), ([7], [])]), None, None),  # declined; numpy reads 5.0 as 5
    (dict(blocks=[([5],), ([7], [])]), "A", "new_block_ids"),  # one list for two groups
    (dict(blocks=[None, None]), "B", "new_block_ids"),  # B's 1 block cannot hold seq_len 5
    (dict(blocks=[([5, 6, 8, 9, 10, 11, 12], []), ([7], [])]), "A", "new_block_ids"),  # > 8 blocks
    (dict(finished={"B"}), "B", "finished_req_ids"),  # finished and scheduled
    (dict(resumed=[False, 1]), None, None),  # not exactly False: numpy path (valid there)
    # the new request D (NewScan, or plan_new_requests when it declines)
    (dict(new_ids=[9, -1, 9]), "D", "prompt_token_ids"),
    (dict(new_ids=[9, 2**31, 9]), "D", "prompt_token_ids"),
    (dict(new_ids=[]), "D", "prompt_token_ids"),
    (dict(new_ids=list(range(33))), "D", "prompt_token_ids"),  # > max_model_len
    (dict(new_ids=(9, 8, 7)), None, None),  # a tuple prompt is fine
    (dict(new_ids=np.array([9, 8, 7], np.int32)), None, None),  # so are int32 / int64 arrays
    (dict(new_ids=np.array([9, 8, 7], np.int64), new_outs=np.array([5], np.int32),
          nst={"A": 1, "B": 1, "D": 4}), None, None),
    (dict(new_ids=np.arange(6, dtype=np.int32)[::2]), None, None),  # strided: numpy path
    (dict(new_ids=np.array([9, -1, 9], np.int32)), "D", "prompt_token_ids"),
    (dict(new_ids=np.array([9, 2**31, 9], np.int64)), "D", "prompt_token_ids"),
    (dict(new_ids=np.array([9.0, 8.0, 7.0])), "D", "prompt_token_ids"),
    (dict(new_outs=[5, 6], nst={"A": 1, "B": 1, "D": 5}), None, None),  # re-sent outputs
    (dict(new_outs=[5, -6]), "D", "output_token_ids"),
    (dict(new_ncts=2, nst={"A": 1, "B": 1, "D": 2}), "D", "num_scheduled_tokens"),  # seq 4 > 3 held
    (dict(new_ncts=-1), "D", "num_computed_tokens"),
    (dict(new_blocks=([6], [])), "D", "block_ids"),  # group 1 has no block for seq_len 2
    (dict(new_blocks=([0], [4])), "D", "block_ids"),  # the null block
    (dict(new_blocks=([6], [10])), "D", "block_ids"),  # outside group 1's pool
    (dict(new_blocks=([6],)), "D", "block_ids"),
    (dict(sp=SamplingParams(temperature=-1.0)), "D", "sampling_params"),
    (dict(sp=SamplingParams(top_p=0.0)), "D", "sampling_params"),
    (dict(sp=SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11)), None, None),
    (dict(sp=SamplingParams(seed=2**64 - 1)), None, None),  # beyond int64: numpy path, still valid
    # found by a differential fuzzer: each once escaped as a non-InvalidSchedulerOutput
    # error, or (seed) changed state before raising on the compiled path
    (dict(sp=SamplingParams(seed=float("nan"))), "D", "sampling_params"),
    (dict(sp=SamplingParams(seed="a")), "D", "sampling_params"),
    (dict(sp=SamplingParams(seed=2**64)), "D", "sampling_params"),
    (dict(sp=SamplingParams(top_p=10**400)), "D", "sampling_params"),
    (dict(sp=SamplingParams(temperature=10**400)), "D", "sampling_params"),
    (dict(sp=SamplingParams(temperature=1e39)), "D", "sampling_params"),  # beyond float32
    (dict(sp=SamplingParams(temperature=float("inf"))), "D", "sampling_params"),
    (dict(sp=SamplingParams(temperature=None)), "D", "sampling_params"),
    (dict(sp=SamplingParams(top_k=2**40)), "D", "sampling_params"),
    (dict(sp=SamplingParams(top_k=None)), "D", "sampling_params"),
    (dict(new_ids=None), "D", "prompt_token_ids"),
    (dict(new_blocks=([6], None)), "D", "block_ids"),
    (dict(new_outs=None), "D", "output_token_ids"),
    (dict(tokens=[None, []]), "A", "new_token_ids"),
    (dict(blocks=[np.array([5]), ([7], [])]), "A", "new_block_ids"),
    (dict(blocks=[([5], None), ([7], [])]), "A", "new_block_ids"),
    (dict(blocks=[([2**63], []), ([7], [])]), "A", "new_block_ids"),
    (dict(nst={"A": 2**63, "B": 1, "D": 2}), "A", "num_scheduled_tokens"),
]


@pytest.mark.parametrize("change,req_id,field", BAD)
def test_irregular_or_bad_cached_parts_fall_back_to_the_same_outcome(change, req_id, field):
    outcomes = []
    for native in (True, False):
        sc = make(native)
        so = regular_step(**change)
        before = sc.snapshot()
        try:
            sc.update_states(so)
        except InvalidSchedulerOutput as e:
            assert not snapshot_diff(sc.snapshot(), before)
            outcomes.append((e.req_id, e.field))
        else:
            inp = sc.prepare_inputs(so)
            b, R = sc.input_batch, inp.num_reqs
            d = sc.requests["D"]
            outcomes.append((inp.req_ids, inp.positions.tolist(), inp.input_ids.tolist(),
                             [s.tolist() for s in inp.slot_mapping], d.all_token_ids, d.num_prompt_tokens,
                             d.block_ids, d.generator is None, sorted(b.generators),
                             [c[:R].tolist() for c in b.row_columns]))
    assert outcomes[0] == outcomes[1]
    if field is not None:
        assert outcomes[0] == (req_id, field)


@pytest.mark.parametrize("seqs,expect", [
    ([[1, 2], (3,), []], [[1, 2], [3], []]),
    ([[0, 2**31 - 1]], [[0, 2**31 - 1]]),
    ([[1], [2**31]], 1),
    ([[1], [-1]], 1),
    ([[True]], 0),  # a bool is no int (the typing rule): the compiled loop declines it, the
    ([[7], [2, False]], 1),  # struct loop (which would read True as 1) finds it
    ([[7], np.array(5)], 1),  # a 0-d array has no len()
    ([np.array([True])], 0),
    ([[1.0]], 0),
    ([[1], [2**70]], 1),
    ([[1], "ab"], 1),
    ([np.array([4, 5], np.int64), [6]], [[4, 5], [6]]),  # arrays take the struct loop
])
def test_pack_int32_agrees_with_the_struct_loop(seqs, expect):
    for native in (True, False):
        out = IntPacker(choose_kernels(native, SamplingParams), 4).pack(seqs)
        assert (out if isinstance(out, int) else [v.tolist() for v in out]) == expect


def test_pack_reports_min_and_max_of_the_batch():
    p = IntPacker(choose_kernels(True, SamplingParams))
    p.pack([[5, 9], [3]])
    assert (p.min, p.max) == (3, 9)


def test_the_extension_can_be_disabled_and_a_stale_build_is_ignored(monkeypatch):
    from attnplug.runner.step.fast import _native
    from attnplug.runner.step.fast import load_native

    assert load_native() is _native
    monkeypatch.setenv("ATTNPLUG_NATIVE", "0")
    assert load_native() is None
    monkeypatch.delenv("ATTNPLUG_NATIVE")
    monkeypatch.setattr(_native, "NATIVE_API", _native.NATIVE_API - 1)  # built from older source
    assert load_native() is None
    assert StepCompiler([4], 2, 16, 8, native=False).native is False


@pytest.mark.parametrize("pad", [8.0, np.float64(8.0), "8"])
def test_a_padding_that_is_not_an_int_is_refused_on_both_paths(pad):
    from attnplug.core.errors import MetadataError

    for native in (True, False):
        sc = make(native)
        so = regular_step()
        sc.update_states(so)
        with pytest.raises(MetadataError, match="must be an int"):
            sc.prepare_inputs(so, num_tokens_padded=pad)
        assert sc.prepare_inputs(so, num_tokens_padded=np.int64(8)).num_padded_tokens == 8


def test_a_request_object_that_mutates_itself_cannot_crash_the_compiled_scan():
    """A request whose property empties its own prompt while it is read: every field is
    read once (``runner/step/check/snapshot.py``) and the compiled scan takes a list's items
    only right before reading them (it once held a stale pointer across the attribute
    access, and crashed under ``python -X dev``)."""

    class Hostile(NewRequestData):
        @property
        def num_computed_tokens(self):
            self.prompt_token_ids.clear()
            [object() for _ in range(100)]
            return 0

        @num_computed_tokens.setter
        def num_computed_tokens(self, value):
            pass

    sc = StepCompiler([4, 8], native=True, **KW)
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(SchedulerOutput([Hostile("H", [7] * 4, ([8], [5]))], CachedRequestData(), {"H": 4}))
    assert (info.value.req_id, info.value.field) == ("H", "prompt_token_ids")
    assert not snapshot_diff(sc.snapshot(), before)


@pytest.mark.parametrize("native", [True, False])
def test_going_back_into_a_null_block_the_scheduler_sent_is_rejected(native):
    """A sliding-window group's skipped prefix arrives as NULL_BLOCK_ID; a cached request
    that later schedules positions there (without being resumed with fresh blocks) would
    read and write the null block. Both paths reject it before changing anything."""
    sc = StepCompiler([4, 4], max_num_reqs=2, max_model_len=32, max_num_batched_tokens=16, num_blocks=20,
                      group_kinds=["full_attention", "sliding_window"], validate=True, native=native)
    sc.update_states(SchedulerOutput([NewRequestData("S", list(range(12)), ([1, 2, 3], [0, 0, 5]), 8)],
                                     CachedRequestData(), {"S": 4}))
    sc.prepare_inputs()
    before = sc.snapshot()
    back = SchedulerOutput([], CachedRequestData(["S"], [False], [[]], [None], [4]), {"S": 1})
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(back)
    assert (info.value.req_id, info.value.field) == ("S", "num_computed_tokens")
    assert "null block" in str(info.value)
    assert not snapshot_diff(sc.snapshot(), before)
