"""The state-backend (Mamba) part of the conformance suite: every case of
``state_cases.STATE_CASES`` (plus ``kind: state`` objects of ``--attnplug-cases``) on every
``--attnplug-backend`` that serves ``"mamba"`` caches, through the runner path, against
the float64 reference recurrence (``state_oracle.py``).

Test ids are ``test_state_<property>[<backend>-<case>]``; attention backends skip them
with the declared reason (their ``kv_cache_kind``), as Mamba backends skip the attention
cases.
"""

from __future__ import annotations

import pytest
import torch

from attnplug.plugins.conformance import state_checks
from attnplug.plugins.conformance.state_oracle import Reference, StateInputs

pytestmark = pytest.mark.attnplug_conformance


def _run(session, spec, case):
    run = session.state_run(spec, case)
    if run.error:
        _fail(run, [run.error], "running the case raised")
    return run


def _fail(run, problems: list[str], what: str) -> None:
    lines = "\n".join(f"  - {p}" for p in problems)
    pytest.fail(f"{state_checks.header(run)}\n{what}:\n{lines}", pytrace=False)


def test_state_outputs_match_recurrence(attnplug_conformance, attnplug_backend, state_case):
    """Every real token's output, in both cache groups, equals the float64 recurrence within
    the dtype's tolerance; padded output rows are left as they were."""
    run = _run(attnplug_conformance, attnplug_backend, state_case)
    problems = state_checks.check_outputs(run, Reference(StateInputs(state_case)))
    if problems:
        _fail(run, problems, "outputs differ from the reference recurrence")


def test_state_slots_hold_the_recurrence_state(attnplug_conformance, attnplug_backend, state_case):
    """After every step each scheduled request's slot holds the conv and SSM states after its
    computed tokens (carried across steps, zeroed for a fresh request, rebuilt after a
    preemption); no other slot changes."""
    run = _run(attnplug_conformance, attnplug_backend, state_case)
    problems = state_checks.check_states(run, Reference(StateInputs(state_case)))
    if problems:
        _fail(run, problems, "state slots are wrong")


def test_state_builders_do_not_mutate_metadata(attnplug_conformance, attnplug_backend, state_case):
    """``build``/``update_block_table`` leave their inputs untouched, and ``forward`` with
    ``update_block_table`` metadata equals ``forward`` with a fresh ``build``."""
    run = _run(attnplug_conformance, attnplug_backend, state_case)
    problems = state_checks.check_metadata(run)
    if problems:
        _fail(run, problems, "the builder's metadata is wrong")


def test_state_cache_allocation_is_well_formed(attnplug_conformance, attnplug_backend):
    """``allocate_state_cache`` returns ``(conv_state, ssm_state)`` shaped
    ``[num_slots, *conv_state_shape]`` / ``[num_slots, *ssm_state_shape]`` in the spec's dtypes."""
    from attnplug.cache_groups.specs import MambaSpec

    backend = attnplug_conformance.backends[attnplug_backend]
    if backend.kv_cache_kind != "mamba":
        pytest.skip(f"the backend serves {backend.kv_cache_kind!r} caches")
    spec = MambaSpec(block_size=64, conv_state_shape=(10, 3), ssm_state_shape=(2, 3, 4), dtype=torch.float16,
                     ssm_dtype=torch.float32, chunk_size=8)
    conv, ssm = backend.allocate_state_cache(spec, 5, "cpu")
    problems = [f"{name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}"
                for name, t, shape, dtype in (("conv_state", conv, (5, 10, 3), torch.float16),
                                              ("ssm_state", ssm, (5, 2, 3, 4), torch.float32))
                if tuple(t.shape) != shape or t.dtype != dtype]
    if problems:
        pytest.fail(f"backend {attnplug_backend!r}: allocate_state_cache(): " + "; ".join(problems), pytrace=False)
