"""The exact words of every stage-1 refusal in ``test_bad_input.CASES``, on both paths.

A refusal's message is what a scheduler author reads first, so it is pinned word for word
in ``tests/runner/step/data/stage1_messages.json`` (reviewed like code): a message that loses
its numbers, its field or its advice fails here, and the compiled path must word each
refusal as the numpy path does. After a deliberate wording change, regenerate the file
with ``ATTNPLUG_UPDATE_MESSAGES=1 pytest tests/runner/step/test_error_messages.py`` and review
the diff. Two refusals ``CASES`` cannot express are pinned here directly: a re-added request
listed twice, and a value whose ``repr`` raises (shown by its type).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.fast import NATIVE

sys.path.insert(0, str(Path(__file__).parent))
import test_bad_input as bad  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "stage1_messages.json"


def _message(mutate, native: bool) -> str:
    sc = bad.make_compiler(native=native)
    cached, nst, new, finished = bad.valid_parts()
    mutate(cached, nst, new, finished)
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(bad.build(cached, nst, new, finished))
    return str(info.value)


def test_every_refusal_is_worded_as_pinned_on_both_paths():
    got = {}
    for param in bad.CASES:
        mutate = param.values[0]
        got[param.id] = _message(mutate, native=False)
        if NATIVE is not None:
            assert _message(mutate, native=True) == got[param.id], f"{param.id}: the compiled path words it otherwise"
    if os.environ.get("ATTNPLUG_UPDATE_MESSAGES") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert set(got) == set(want), "cases added or removed: regenerate the file (see the module docstring)"
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not wrong, wrong


def _stage8_messages() -> dict[str, str]:
    """Stage-8 refusals (``MetadataError``) of the runner's own calls, each on a fresh state."""
    from attnplug.core.errors import MetadataError
    from attnplug.runner.step.compiler import StepCompiler
    from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    def partial():  # P prefills 4 of 10 tokens: its logits are discarded
        sc = StepCompiler([4], 2, 12, 16)
        so = SchedulerOutput([NewRequestData("P", list(range(10)), ([1, 2, 3],)), NewRequestData("D", [1, 2], ([4],))],
                             CachedRequestData(), {"P": 4, "D": 2})
        sc.update_states(so)
        sc.prepare_inputs(so)
        return sc
    calls = {
        "append discarded": lambda sc: sc.append_output_tokens(["D", "P"], [7, 7]),
        "append unknown": lambda sc: sc.append_output_tokens(["Q"], [7]),
        "append twice": lambda sc: sc.append_output_tokens(["D", "D"], [7, 8]),
        "append rows range": lambda sc: sc.append_output_tokens([5], [7]),
        "append entries": lambda sc: sc.append_output_tokens(["D"], [7, 8]),
        "append range": lambda sc: sc.append_output_tokens(["D"], [2**31]),
        "append past max_model_len": lambda sc: sc.append_output_tokens(["D"], [list(range(11))]),
        "placeholders discarded": lambda sc: sc.append_placeholders([1, 0]),
        "verified discarded": lambda sc: sc.append_verified_tokens([0], [[5]]),
        "verified rows": lambda sc: sc.append_verified_tokens([1, 1], [[5], [6]]),
        "verified row at num_reqs": lambda sc: sc.append_verified_tokens([2], [[5]]),
        "verified lists": lambda sc: sc.append_verified_tokens([1], [[5], [6]]),
    }
    out = {}
    for name, call in calls.items():
        sc = partial()
        with pytest.raises(MetadataError) as info:
            call(sc)
        out[name] = str(info.value)
    return out


def test_stage_8_refusals_are_worded_as_pinned():
    got = _stage8_messages()
    path = GOLDEN.with_name("stage8_messages.json")
    if os.environ.get("ATTNPLUG_UPDATE_MESSAGES") == "1":
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    assert got == want


PATHS = [False] + ([True] if NATIVE is not None else [])


@pytest.mark.parametrize("native", PATHS)
def test_a_readded_request_listed_twice_is_worded_as_such(native):
    """C (resident, out of the batch) twice among the cached requests: not "unknown"."""
    from attnplug.runner.step.compiler import snapshot_diff
    from attnplug.runner.step.scheduler_output import CachedRequestData, SchedulerOutput

    sc = bad.make_compiler(native=native)
    before = sc.snapshot()
    cd = CachedRequestData(["A", "B", "C", "C"], [False] * 4, [[61], [71], [], []], [None, ([5], []), None, None],
                           [7, 4, 2, 2])
    with pytest.raises(InvalidSchedulerOutput) as info:
        sc.update_states(SchedulerOutput([], cd, {"A": 1, "B": 1, "C": 1}))
    assert str(info.value) == "request 'C': scheduled_cached_reqs: request listed twice"
    assert not snapshot_diff(before, sc.snapshot())


class _Opaque:
    def __repr__(self):
        raise RuntimeError("no repr")


@pytest.mark.parametrize("native", PATHS)
def test_a_value_whose_repr_raises_is_shown_by_its_type(native):
    def mutate(cached, nst, new, finished):
        cached["B"]["blocks"] = ([5], _Opaque())
    assert _message(mutate, native) == ("request 'B': new_block_ids: group 1: expected a list of block ids (or a "
                                        "1-D integer array), got <_Opaque whose repr raised RuntimeError>")
