"""``prepare_inputs`` checks its own arguments before the kernels run, so that a refused
step consumes nothing (the asynchronous patch's columns stay) and the retry patches, on
both kernel paths alike:

- the output's ``total_num_scheduled_tokens``, read once and typed by stage 1's rule (an
  ``int`` or numpy integer, never a ``bool``: ``runner/step/step_size.py``), then held to
  the step's count; a numpy integer total of the right count is taken as the ``int``;
- an object that is not a ``SchedulerOutput``;
- ``num_tokens_padded`` that is a bool of any kind;
- a one-token ``prev_token_ids`` view of any stride (counted contiguous by torch), whose
  token is checked in ``[0, 2**31)`` as a plain tensor's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core.errors import InvalidSchedulerOutput, MetadataError
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
    words = "but the batch holds 1 scheduled" if type(BAD_TOTALS[name]) is int and BAD_TOTALS[name] in (2,) \
        or name == "a numpy int of another count" else "must be an int in [0, 2**62)"
    assert words in str(info.value), str(info.value)
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
    assert str(info.value) == (f"total_num_scheduled_tokens: must be an int in [0, 2**62), got {shown}: not an "
                               "output update_states took")


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("other", [{"a": 1}, "so", 1])
def test_an_object_that_is_not_a_scheduler_output_is_refused_and_changes_nothing(native, other):
    sc, nxt = pending_patch(native)
    before = sc.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.prepare_inputs(other, prev_token_ids=torch.tensor([70]))
    assert info.value.field == "scheduler_output"
    assert str(info.value) == ("scheduler_output: expected the SchedulerOutput update_states just applied, got "
                               f"{type(other).__name__}")
    assert not snapshot_diff(before, sc.snapshot())
    assert sc.prepare_inputs(nxt, prev_token_ids=torch.tensor([70])).input_ids.tolist() == [70]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("pad", [True, False, torch.tensor(True), np.bool_(True)])
def test_a_bool_padding_is_refused_as_not_an_int(native, pad):
    sc, nxt = pending_patch(native)
    before = sc.snapshot()
    with pytest.raises(MetadataError, match="^num_tokens_padded must be an int, got "):
        sc.prepare_inputs(nxt, num_tokens_padded=pad, prev_token_ids=torch.tensor([70]))
    assert not snapshot_diff(before, sc.snapshot())


ONE_TOKEN_VIEWS = {"every other of two": lambda v: torch.tensor([v, 0])[::2],
                   "a 0-d tensor expanded": lambda v: torch.tensor(v).expand(1),
                   "stride 7": lambda v: torch.tensor([v] * 8).as_strided((1,), (7,))}


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", list(ONE_TOKEN_VIEWS))
@pytest.mark.parametrize("value", [-5, 2**40])
def test_a_one_token_view_of_any_stride_is_checked_like_a_plain_tensor(native, name, value):
    """A one-element tensor counts as contiguous whatever its stride (``.contiguous()``
    makes no copy): its token is still checked in ``[0, 2**31)`` on both paths, and a good
    one patches."""
    sc, nxt = pending_patch(native)
    before = sc.snapshot()
    with pytest.raises(MetadataError, match=f"prev_token_ids entry 0 is {value}, not a token id"):
        sc.prepare_inputs(nxt, prev_token_ids=ONE_TOKEN_VIEWS[name](value))
    assert not snapshot_diff(before, sc.snapshot())
    assert sc.prepare_inputs(nxt, prev_token_ids=ONE_TOKEN_VIEWS[name](71)).input_ids.tolist() == [71]
