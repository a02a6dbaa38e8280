"""The state-backend part of the conformance suite: every case of
``state_cases.STATE_CASES`` (plus ``kind: state`` objects of ``--attnplug-cases``) on every
``--attnplug-backend`` that serves ``"mamba"`` (state) caches, in the backend's state kind
(Mamba2, Gated DeltaNet: ``state_kinds.py``), through the runner path, against the float64
reference recurrence (``state_oracle.py``).

Test ids are ``test_state_<property>[<backend>-<case>]``; attention backends skip them
with the declared reason (their ``kv_cache_kind``), as Mamba backends skip the attention
cases.
"""

from __future__ import annotations

import pytest
import torch

from attnplug.plugins.conformance import state_checks

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
    problems = state_checks.check_outputs(run, state_checks.reference(run))
    if problems:
        _fail(run, problems, "outputs differ from the reference recurrence")


def test_state_slots_hold_the_recurrence_state(attnplug_conformance, attnplug_backend, state_case):
    """After every step each scheduled request's slot holds the conv and SSM states after its
    computed tokens (carried across steps, zeroed for a fresh request, rebuilt after a
    preemption); no other slot changes."""
    run = _run(attnplug_conformance, attnplug_backend, state_case)
    problems = state_checks.check_states(run, state_checks.reference(run))
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
    """``allocate_state_cache`` returns one tensor per declared state tensor, in declaration
    order, shaped ``[num_slots, *shape]`` in the declared dtype (the spec of the backend's
    ``state_kind``: Mamba2 ``conv_state`` / ``ssm_state``, GDN ``conv_state`` /
    ``recurrent_state``)."""
    from attnplug.plugins.conformance.state_cases import StateCase
    from attnplug.plugins.conformance.state_kinds import kind_of

    backend = attnplug_conformance.backends[attnplug_backend]
    if backend.kv_cache_kind != "mamba":
        pytest.skip(f"the backend serves {backend.kv_cache_kind!r} caches")
    kind = kind_of(backend)
    if kind is None:
        pytest.skip(f"no conformance model of state kind {backend.state_kind!r} (plugins/conformance/state_kinds.py)")
    case = StateCase(name="alloc", steps=(((0, 1),),), num_heads=2, head_size=3, state_size=4, n_groups=1,
                     conv_kernel_size=4, chunk_size=8, dtype="float16")
    spec = kind.spec(case, 64)
    cache = backend.allocate_state_cache(spec, 5, "cpu")
    got = [(tuple(t.shape), t.dtype) for t in cache]
    want = [((5, *t.shape), t.dtype) for t in spec.tensors]
    if got != want:
        pytest.fail(f"backend {attnplug_backend!r}: allocate_state_cache() of {[t.name for t in spec.tensors]} "
                    f"returned {got}, expected {want}", pytrace=False)
