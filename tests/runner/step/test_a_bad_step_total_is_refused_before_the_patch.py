"""``prepare_inputs`` reads the output's ``total_num_scheduled_tokens`` once and types it by
stage 1's rule (an ``int`` or numpy integer, never a ``bool``) before the kernels run
(``runner/step/step_size.py``): a total of another type, or of the wrong count, refuses the
step with nothing consumed (the asynchronous patch's columns stay), on both kernel paths,
and the retry with the applied output patches. A numpy integer total equal to the count
is taken as the ``int``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

PATHS = [None, False] if kernels_available() else [False]


def _decode(ncc: int) -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData(["a"], [False], [[]], [None], [ncc]), {"a": 1})


def pending_patch(native) -> tuple[StepCompiler, SchedulerOutput]:
    """Request "a" prefilled and sampled, one decode step whose token stayed on the device
    (a placeholder), and the next step applied, not yet prepared."""
    sc = StepCompiler([4], max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64, native=native,
                      validate=True)
    first = SchedulerOutput([NewRequestData("a", [1, 2, 3], ([1, 2],))], CachedRequestData(), {"a": 3})
    sc.update_states(first)
    sc.prepare_inputs(first)
    sc.append_output_tokens([0], [100])
    dec = _decode(3)
    sc.update_states(dec)
    sc.prepare_inputs(dec)
    sc.append_placeholders([0])
    nxt = _decode(4)
    sc.update_states(nxt)
    return sc, nxt


BAD_TOTALS = {"a numpy int of another count": np.int64(2), "a float": 1.0, "a str": "1", "a bool": True,
              "past 2**62": 2**62, "negative": -1, "None": None, "another int": 2}


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", list(BAD_TOTALS))
def test_a_bad_total_refuses_the_step_and_consumes_nothing(native, name):
    sc, nxt = pending_patch(native)
    bad = _decode(4)
    bad.total_num_scheduled_tokens = BAD_TOTALS[name]
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.prepare_inputs(bad, prev_token_ids=torch.tensor([70]))
    assert info.value.field == "total_num_scheduled_tokens"
    assert "call update_states with this output first" in str(info.value)
    assert not snapshot_diff(before, sc.snapshot())
    assert sc.prepare_inputs(nxt, prev_token_ids=torch.tensor([70])).input_ids.tolist() == [70]


@pytest.mark.parametrize("native", PATHS)
def test_a_numpy_integer_total_of_the_right_count_is_taken(native):
    sc, nxt = pending_patch(native)
    nxt.total_num_scheduled_tokens = np.int32(1)
    assert sc.prepare_inputs(nxt, prev_token_ids=torch.tensor([71])).input_ids.tolist() == [71]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("total, shown", [(1.0, "1.0"), ("1", "'1'"), (True, "True"), (2**62, str(2**62)), (-1, "-1")])
def test_a_mistyped_total_is_named_in_the_refusal(native, total, shown):
    sc, _ = pending_patch(native)
    bad = _decode(4)
    bad.total_num_scheduled_tokens = total
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.prepare_inputs(bad)
    assert str(info.value) == (f"total_num_scheduled_tokens: must be an int in [0, 2**62), got {shown}: call "
                               "update_states with this output first")
