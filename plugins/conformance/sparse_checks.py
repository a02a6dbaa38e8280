"""The sparse families' checks: each returns the problems it found (empty: passed), every
line naming the case (and the query token), so a failure says which property broke.

Selector: every index is ``-1`` or a position of the query's own request at or before its
own (never a future token); as many as it sees keys, up to ``index_topk``, distinct, then
``-1``; the selected set is a top-k of the float64 reference scores (ordered, within a
tolerance for near ties) and, in the ``ties`` case (small integers: every score exact),
equals the reference (lower position first); key rows written exactly at the slot mapping; padded rows all ``-1``.
Consumer: output equals dense attention with the unselected keys masked (``-1`` ignored);
no NaN (no poisoned row read); padded rows untouched.
"""

from __future__ import annotations

import torch

from attnplug.plugins.conformance.snapshots import rows_written_outside
from attnplug.plugins.conformance.sparse_harness import (
    OUTPUT_SENTINEL,
    SelectorRun,
    SelectorStep,
    SparseMLARun,
    SparseMLAStep,
    query_positions,
)

SCORE_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}
"""How far below the k-th best reference score a selected key's score may be (relative to
the query's largest score magnitude, >= 1): rounding may swap near ties, never more."""

OUT_TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _query_problems(step: SelectorStep, t: int, got: list[int]) -> list[str]:
    case = step.case
    req, pos = query_positions(case)[t]
    k = case.index_topk
    where = f"case {case.name!r}: query token {t} (request {req}, position {pos})"
    want_n = min(k, pos + 1)
    sel = [i for i in got if i != -1]
    if any(i < -1 for i in got):
        return [f"{where}: index {min(got)} < -1 (only -1 means none)"]
    future = [i for i in sel if i > pos]
    if future:
        return [f"{where}: selected future token(s) {future[:4]} (causal: positions 0..{pos} only)"]
    if got[: len(sel)] != sel or len(sel) != want_n:
        return [f"{where}: {len(sel)} selected, -1 not only at the end ({got}); expected {want_n} "
                f"(min(index_topk {k}, keys seen {pos + 1})) then -1"]
    if len(set(sel)) != len(sel):
        return [f"{where}: a position selected twice: {sel}"]
    s = step.scores(t)
    ref = step.reference()[t, :want_n].tolist()
    tol = SCORE_TOL[step.dtype] * max(1.0, float(s.abs().max()))
    kth = float(s[ref[-1]])
    low = [i for i in sel if float(s[i]) < kth - tol]
    if low:
        return [f"{where}: position(s) {low[:4]} score below the {want_n}-th best ({float(s[low[0]]):.4g} < "
                f"{kth:.4g}): not the top-k of its own request's keys (another request's keys scored?)"]
    order = [float(s[i]) for i in sel]
    if any(b > a + tol for a, b in zip(order, order[1:])):
        return [f"{where}: not in descending score order: {sel}"]
    # exact order only where every score is exact (the ties case's small integers): elsewhere
    # rounding may make or break a tie (a ReLU at 0), which the tolerance above allows
    if step.case.ties and sel != ref:
        return [f"{where}: tied scores must go to the lower position first: got {sel}, expected {ref}"]
    return []


def check_selection(step: SelectorStep, run: SelectorRun) -> list[str]:
    """Per query: causal, own request, count, order, top-k (ties exact); padded rows -1."""
    t = len(query_positions(step.case))
    problems = []
    for tok in range(t):
        problems += _query_problems(step, tok, run.indices[tok].tolist())
    pad = run.indices[t:]
    if pad.numel() and not bool((pad == -1).all()):
        problems.append(f"case {step.case.name!r}: padded rows {t}..{run.indices.shape[0] - 1} are not all -1")
    return problems


def check_key_cache(run: SelectorRun) -> list[str]:
    """Each real token's slot holds its key row bit for bit; no other row changed."""
    case = run.case
    before = run.cache_before.view(-1, run.cache_before.shape[-1])
    after = run.cache_after.view(-1, run.cache_after.shape[-1])
    t = sum(case.num_scheduled_tokens)
    slots = run.slot_mapping[:t]
    problems = []
    bad = (after[slots] != run.new_rows).any(1).nonzero().flatten().tolist()
    if bad:
        problems.append(f"case {case.name!r}: indexer key rows of tokens {bad[:8]} differ from k at their slots")
    changed = rows_written_outside(before, after, slots)
    if changed:
        problems.append(f"case {case.name!r}: indexer cache rows {changed[:8]} changed though no token maps there")
    return problems


def check_sparse_output(step: SparseMLAStep, run: SparseMLARun) -> list[str]:
    """Real rows equal dense attention over the selected keys only; padded rows untouched."""
    case = step.case
    t = len(query_positions(case))
    got, want = run.output[:t], step.reference()
    where = f"case {case.name!r}"
    if torch.isnan(got).any():
        rows = torch.isnan(got).flatten(1).any(1).nonzero().flatten().tolist()
        return [f"{where}: NaN in token rows {rows[:8]}: a poisoned cache row outside the selection was read"]
    scale = max(1.0, float(want.abs().max()))
    err = (got.double() - want).abs().flatten(1).max(1).values
    problems = []
    if float(err.max()) > OUT_TOL[step.dtype] * scale:
        worst = int(err.argmax())
        problems.append(f"{where}: output vs dense attention over the selected keys: max abs error "
                        f"{float(err.max()):.3g} (worst query token {worst}, selection "
                        f"{step.indices[worst].tolist()}): a -1 read as a position, or a key outside the selection")
    pad = run.output[t:]
    if pad.numel() and not bool((pad == OUTPUT_SENTINEL).all()):
        problems.append(f"{where}: padded output rows {t}..{run.output.shape[0] - 1} were written")
    return problems
