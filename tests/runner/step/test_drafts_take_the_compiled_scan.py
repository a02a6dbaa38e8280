"""A step that verifies drafts takes the same kernels as any other step: the compiled
cached scan plans it (drafts checked in the same pass), and the inputs, the drafts in the
token table and the ``SpecDecodeMetadata`` equal the numpy kernels' byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the compiled kernels are not built")


def _steps() -> list[SchedulerOutput]:
    """a, b and c decode; a verifies 3 drafts, b 1 (both append a block), c none."""
    new = [NewRequestData("a", list(range(7)), ([1, 2],), 6), NewRequestData("b", list(range(8)), ([3, 4],), 7),
           NewRequestData("c", [5, 6], ([5],), 1)]
    first = SchedulerOutput(new, CachedRequestData(), {"a": 1, "b": 1, "c": 1})
    cached = CachedRequestData(["a", "b", "c"], [False] * 3, [[], [], []], [([7],), ([6],), None], [7, 8, 2])
    drafts = SchedulerOutput([], cached, {"a": 4, "b": 2, "c": 1},
                             scheduled_spec_decode_tokens={"a": [11, 12, 13], "b": [14]})
    return [first, drafts]


def _run(native: bool):
    sc = StepCompiler([4], 4, 32, 32, num_blocks=16, native=native, validate=True)
    first, drafts = _steps()
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens(["a", "b", "c"], [7, 8, 9])
    plan = sc.checker.plan(drafts)
    scanned = sc.checker.last_scanned
    sc.apply(plan)
    return sc, sc.prepare_inputs(drafts), scanned


def test_a_draft_step_is_planned_by_the_compiled_scan_and_matches_numpy():
    fast, a, scanned = _run(True)
    slow, b, slow_scanned = _run(False)
    assert scanned and not slow_scanned
    for name in ("input_ids", "positions", "seq_lens", "query_start_loc"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a.slot_mapping[0].tolist() == b.slot_mapping[0].tolist()
    assert a.input_ids.tolist() == [7, 11, 12, 13, 8, 14, 9]
    ma, mb = a.spec_decode_metadata, b.spec_decode_metadata
    assert ma.num_draft_tokens == mb.num_draft_tokens == [3, 1, 0]
    for name in ("draft_token_ids", "cu_num_draft_tokens", "target_logits_indices", "bonus_logits_indices",
                 "logits_indices"):
        assert getattr(ma, name).tolist() == getattr(mb, name).tolist(), name
    assert (fast.input_batch.num_spec_tokens == slow.input_batch.num_spec_tokens).all()
    assert np.array_equal(fast.input_batch.token_ids_cpu, slow.input_batch.token_ids_cpu)


def test_irregular_drafts_are_declined_and_refused_as_on_the_numpy_path():
    sc, _, _ = _run(True)
    sc.append_verified_tokens([0, 1, 2], [[11, 12, 13, 5], [14, 6], [7]])
    before = sc.snapshot()
    # drafts for a request that is not scheduled in this output: the scan declines
    so = SchedulerOutput([], CachedRequestData(["a"], [False], [[]], [([8],)], [11]), {"a": 2},
                         scheduled_spec_decode_tokens={"a": [1], "c": [2]})
    with pytest.raises(Exception) as info:
        sc.update_states(so)
    assert not sc.checker.last_scanned
    assert "scheduled_spec_decode_tokens" in str(info.value)
    assert sc.snapshot().keys() == before.keys()
