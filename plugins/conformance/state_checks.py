"""The properties the suite checks on a state run (:class:`~attnplug.plugins.conformance.
state_harness.StateRun`), against the float64 reference recurrence of the run's state kind (``state_oracle.py``,
``state_kinds.py``).

Each ``check_*`` returns a list of problems (empty: the property holds), each naming the
step, cache group, request, position or slot concerned.
"""

from __future__ import annotations

import torch

from attnplug.plugins.conformance.checks import MAX_LISTED, TOLERANCES
from attnplug.plugins.conformance.poison import bits
from attnplug.plugins.conformance.state_harness import OUTPUT_SENTINEL, StateRun
from attnplug.plugins.conformance.state_kinds import KINDS, display_name
from attnplug.plugins.conformance.state_oracle import Reference, StateInputs


def header(run: StateRun) -> str:
    return (f"state case {run.case.name!r} on backend {run.backend_name!r} ({run.state_kind} state, device "
            f"{run.device})\n  case JSON: {run.case.describe()}")


def reference(run: StateRun) -> Reference:
    """The float64 reference of the run's case in the run's state kind."""
    return Reference(StateInputs(run.case, kind=KINDS[run.state_kind]))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> torch.Tensor:
    atol, rtol = TOLERANCES[dtype]
    return (got.double() - want).abs() <= atol + rtol * want.abs()   # NaN: False


def check_outputs(run: StateRun, ref: Reference) -> list[str]:
    """Every real token's output equals the recurrence's ``y`` at (request, position);
    padded rows keep the sentinel the harness wrote."""
    atol, rtol = TOLERANCES[run.case.dtype]
    problems = []
    for step in run.steps:
        Q = len(step.token_req)
        for g, grp in enumerate(step.groups):
            bad = []
            for t in range(Q):
                if step.checked is not None and not step.checked[t]:
                    continue   # a rejected draft: fed other inputs, outside the reference
                r, p = int(step.token_req[t]), int(step.token_pos[t])
                got, want = grp.output[t].flatten(), ref.y[r][p].flatten()
                ok = _close(got, want, run.case.dtype)
                if not bool(ok.all()):
                    c = int((~ok).nonzero()[0, 0])
                    nan = " (NaN: a slot's stale state or a NaN slot was read)" if bool(torch.isnan(got).any()) else ""
                    bad.append(f"request r{r} position {p} channel {c}: got {float(got[c]):.6g}, expected "
                               f"{float(want[c]):.6g}{nan}")
            if bad:
                problems.append(f"step {step.index}, cache group {g}: {len(bad)} token(s) differ from the reference "
                                f"recurrence beyond atol={atol} rtol={rtol}: " + "; ".join(bad[:MAX_LISTED])
                                + (" ..." if len(bad) > MAX_LISTED else ""))
            pad = grp.output[Q:]
            if pad.numel() and not torch.equal(bits(pad), bits(torch.full_like(pad, OUTPUT_SENTINEL))):
                problems.append(f"step {step.index}, cache group {g}: padded output rows {Q}..{grp.output.shape[0] - 1} "
                                "were written (rows past num_actual_tokens must be left as they are)")
    return problems


def check_states(run: StateRun, ref: Reference) -> list[str]:
    """After each step, every scheduled request's slot holds the recurrence's state (every
    declared tensor: conv and SSM / recurrent state) after its computed tokens (a verifying
    row: after the runner's commit, the state of the accepted prefix), and no other slot changed (bit for bit; a verifying row's
    scratch slots may)."""
    problems = []
    for step in run.steps:
        for g, grp in enumerate(step.groups):
            for r, slot in grp.slots.items():
                n = step.computed_after[r]
                for j, tname in enumerate(grp.names):
                    name, got, want = display_name(tname), grp.after[j][slot], ref.states[r][j][n]
                    ok = _close(got, want, run.case.dtype)
                    if not bool(ok.all()):
                        idx = tuple(int(i) for i in (~ok).nonzero()[0])
                        problems.append(f"step {step.index}, cache group {g}: request r{r}'s {name} in slot {slot} "
                                        f"after {n} tokens differs from the recurrence at {list(idx)}: got "
                                        f"{float(got[idx]):.6g}, expected {float(want[idx]):.6g}")
            owned = set(grp.slots.values()) | grp.scratch
            for tname, before, after in zip(grp.names, grp.before, grp.after):
                name = display_name(tname)
                changed = (bits(before) != bits(after)).flatten(1).any(dim=1).nonzero().flatten().tolist()
                stray = [s for s in changed if s not in owned]
                if stray:
                    problems.append(f"step {step.index}, cache group {g}: {name} of slot(s) {stray} changed, "
                                    f"but the step's requests hold slots {sorted(owned)} (a padded row's write, "
                                    "PAD_SLOT_ID = -1 used as an index, the null slot 0 written, or a stray write)")
    return problems


def check_metadata(run: StateRun) -> list[str]:
    """Builders leave their inputs untouched; ``update_block_table`` == a fresh ``build``."""
    out = [f"step {s.index}: {m}" for s in run.steps for m in s.mutations]
    out += [f"step {s.index}: update_block_table(): {d}" for s in run.steps for d in (s.update_vs_fresh or [])]
    return out
