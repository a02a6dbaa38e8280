"""On the compiled kernels a valid stage-8 call is one compiled pass (``SampledRows``,
``runner/step/fast/_native_stage8.pxi``): ``append_output_tokens`` with one token a row,
``append_verified_tokens``, ``append_placeholders`` and ``fill_output_tokens`` never reach
the numpy code, which only words refusals. A pass that declined valid input would still
give the right state (the numpy code writes it), so only this test sees it: the numpy
code's first call is made to fail here, and the results are checked against the numpy
kernels' on the same steps."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from attnplug.runner.step import append, placeholders, spec_apply
from attnplug.runner.step.compiler import snapshot_diff
from attnplug.runner.step.fast import NATIVE

sys.path.insert(0, str(Path(__file__).parent))
from test_spec_decode_bad_input import make_compiler, step  # noqa: E402

pytestmark = pytest.mark.skipif(NATIVE is None, reason="the compiled kernels are not built")


@pytest.fixture
def numpy_code_refused(monkeypatch):
    """The numpy code of each stage-8 call fails at its first step."""
    def refuse(*args, **kwargs):
        raise AssertionError("a valid stage-8 call reached the numpy code")
    for module in (append, spec_apply, placeholders):
        monkeypatch.setattr(module, "rows_distinct", refuse)
    monkeypatch.setattr(placeholders, "_fill_rows", refuse)


def _run(native: bool, refuse=None) -> list:
    """A verifying step (A: 3 drafts, 2 accepted), then a synchronous step, then an
    asynchronous one (placeholders appended, patched, filled). Returns the snapshots."""
    sc, snaps = make_compiler(native), []
    if refuse is not None:
        refuse()
    so = step({"A": [5, 6, 7]})
    sc.update_states(so)
    inputs = sc.prepare_inputs(so)
    rA = sc.input_batch.req_id_to_index["A"]
    assert np.flatnonzero(~inputs.discard).tolist() == [rA]
    sc.append_verified_tokens([rA], [[5, 6, 50]])  # two drafts accepted, then the corrected token
    snaps.append(sc.snapshot())
    so = step({}, ncc=(11, 6), blocks=[None, None])
    sc.update_states(so)
    inputs = sc.prepare_inputs(so)
    keep = np.flatnonzero(~inputs.discard)
    sc.append_output_tokens(keep, [60 + i for i in range(keep.shape[0])])
    snaps.append(sc.snapshot())
    so = step({}, nst={"A": 1, "B": 2}, ncc=(12, 10), blocks=[([7],), None])
    sc.update_states(so)
    inputs = sc.prepare_inputs(so)
    keep = np.flatnonzero(~inputs.discard)
    ph = sc.append_placeholders(keep)
    snaps.append(sc.snapshot())
    assert sc.fill_output_tokens(ph, [70 + i for i in range(keep.shape[0])]) == keep.shape[0]
    snaps.append(sc.snapshot())
    return snaps


def test_every_valid_stage8_call_is_one_compiled_pass(numpy_code_refused):
    compiled = _run(True)
    assert len(compiled) == 4


def _data(snap: dict) -> dict:
    """The snapshot without object identities (they differ between two compilers)."""
    out = {k: v for k, v in snap.items() if k not in ("states_by_row", "requests", "generators")}
    out["requests"] = {rid: st[1:-1] for rid, st in snap["requests"].items()}
    return out


def test_the_compiled_passes_leave_the_numpy_kernels_state():
    for a, b in zip(_run(True), _run(False)):
        assert not snapshot_diff(_data(a), _data(b))
