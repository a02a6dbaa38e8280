"""A new request's ``temperature`` and ``top_p`` at and past the bounds the batch columns
hold (``[0, float32 max]``, ``(0, 1]``), and parameters of the wrong type: accepted at the
bound, refused one step past it, with the request and the field named and nothing
changed, on both kernel paths (the checks' fast path for plain floats and ints included).
``top_k``'s and ``seed``'s integer bounds: ``test_stage1_refusals_and_bounds.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

NATIVE = [False] + ([True] if kernels_available() else [])
F32_MAX = float(np.finfo(np.float32).max)


def _admit(native: bool, sp: SamplingParams) -> StepCompiler:
    sc = StepCompiler([4], 4, 32, 32, num_blocks=16, native=native)
    so = SchedulerOutput([NewRequestData("N", [1, 2], ([3],), 0, sampling_params=sp)], CachedRequestData(), {"N": 2})
    sc.update_states(so)
    return sc


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("params", [
    dict(temperature=0.0), dict(temperature=F32_MAX), dict(top_p=1.0), dict(top_p=5e-324),
    dict(temperature=1, top_p=1, top_k=np.int64(5)),  # ints and numpy ints where floats are usual
], ids=repr)
def test_sampling_params_at_their_bounds_are_admitted(native, params):
    sc = _admit(native, SamplingParams(**params))
    assert sc.input_batch.req_id_to_index == {"N": 0}


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("params", [
    dict(temperature=-1e-300), dict(temperature=math.inf), dict(temperature=math.nan), dict(temperature=F32_MAX * 1.0001),
    dict(top_p=1.0000001), dict(top_p=0.0), dict(top_p=math.nan), dict(top_p=-0.5),
    dict(top_k=True), dict(top_k=1.0), dict(seed=True), dict(temperature=True), dict(top_p="1"),
], ids=repr)
def test_sampling_params_past_their_bounds_are_refused_naming_the_request(native, params):
    sc = StepCompiler([4], 4, 32, 32, num_blocks=16, native=native)
    so = SchedulerOutput([NewRequestData("N", [1, 2], ([3],), 0, sampling_params=SamplingParams(**params))],
                         CachedRequestData(), {"N": 2})
    with pytest.raises(InvalidSchedulerOutput) as e:
        sc.update_states(so)
    assert e.value.req_id == "N" and e.value.field == "sampling_params", str(e.value)
    assert sc.input_batch.num_reqs == 0 and sc.requests == {}
