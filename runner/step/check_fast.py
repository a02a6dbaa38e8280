"""The compiled planning path of ``update_states`` for regular scheduler outputs.

A regular output is what a scheduler sends almost every step: every cached request is
in the batch, scheduled once, not resumed, carries no token deltas, and appends block
ids (lists of ints) that fit. ``CachedScan.scan`` (``runner/step/fast/_native_cached.pxi``) checks
all of that in one pass over the cached requests and plans their merge; ``NewScan.scan``
(``runner/step/fast/_native_admit.pxi``) checks and stages the new requests (when it declines,
``check_new.plan_new_requests`` plans them as on the numpy path); finished ids were checked by
``check_finished_and_new`` for both paths. When the cached scan declines (anything
irregular, including every invalid input), ``plan_update`` runs the numpy path, which
accepts every valid output and words every error. The two paths produce the same state
(``tests/runner/test_native_paths.py`` and the step-oracle tests run both).
"""

from __future__ import annotations

from typing import Callable, Sequence

from attnplug.runner.step.check_snapshot import Deltas, NewReq
from attnplug.runner.step.fast.bind import Scans
from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.plan import UpdatePlan
from attnplug.runner.step.request_state import CachedRequestState

PlanNew = Callable[[Sequence[NewReq], Sequence[int]], list[CachedRequestState]]


def plan_update_native(lay: StepLayout, batch: InputBatch, scans: Scans, plan_new: PlanNew, so: Deltas,
                       finished: list[str], fin_set: set[str]) -> UpdatePlan | None:
    """Plan ``so`` with the compiled scan, or return ``None`` (take the numpy path).

    Call after ``check_finished_and_new``. Changes nothing.

    Args:
        lay, batch: the step layout and the batch the scans are bound to.
        scans: the compiled scans (``runner/step/fast/bind.py``).
        plan_new: the numpy check of new requests (``check_new.plan_new_requests`` with
            its packers), for new requests the compiled ``NewScan`` declines.

    Raises:
        InvalidSchedulerOutput: a bad new request (the cached part was valid, so this is
            the error the numpy path would raise too).
    """
    scan = scans.cached
    idx = batch.req_id_to_index
    cached = so.scheduled_cached_reqs
    nst = so.num_scheduled_tokens
    new_reqs = so.scheduled_new_reqs
    C = cached.req_ids
    try:
        ok = scan.scan(C, idx, cached.num_computed_tokens, nst, cached.new_token_ids, cached.new_block_ids,
                       cached.resumed_from_preemption, finished)
    except TypeError:  # a field that is not a list (e.g. a tuple): irregular
        return None
    nC, nN = len(C), len(new_reqs)
    if not ok or len(nst) != nC + nN or nC + nN > lay.max_num_reqs:
        return None
    new_counts = []
    for nr in new_reqs:
        c = nst.get(nr.req_id)
        if type(c) is not int or c < 1:
            return None
        new_counts.append(c)
    total = scan.total_tokens + sum(new_counts)
    if total > lay.max_num_batched_tokens or type(so.total_num_scheduled_tokens) is not int \
            or so.total_num_scheduled_tokens != total:
        return None
    # C and the new ids are disjoint and duplicate-free (scan + check_finished_and_new), all
    # found in nst, and len(nst) == nC + nN: nst holds exactly the scheduled requests.
    new_scanned = None
    if new_reqs and scans.new.scan(new_reqs if type(new_reqs) is list else list(new_reqs), new_counts):
        new_states, new_scanned = [], new_reqs
    else:
        new_states = plan_new(new_reqs, new_counts)
    fin_in_batch = sum(1 for rid in finished if rid in idx)
    unscheduled: list[str] = []
    if batch.num_reqs - fin_in_batch > nC:
        unscheduled = [rid for rid, r in idx.items() if not scan.is_scheduled(r) and rid not in fin_set]
    return UpdatePlan(finished, unscheduled, new_states, new_counts, [], [], None, None, None,
                      new_scanned=new_scanned, native=True)
