"""Stage 1 through the kernels' scans, for regular scheduler outputs.

A regular output is what a scheduler sends almost every step: every cached request is
in the batch, scheduled once, not resumed, carries no token deltas, appends block ids
(lists of ints) that fit, and verifies drafts only on decoding rows. The kernels'
``scan_cached`` (``runner/step/kernels.py``; compiled: the ``CachedScan`` of
``runner/step/fast/``) checks all of that in one pass and writes the plan into the
checker's :class:`ScanBuffers`;
``scan_new`` checks and stages the new requests (when it declines,
``check.new.plan_new_requests`` plans them as on the numpy path); finished ids were
checked by ``check_finished_and_new`` for both paths. When the cached scan declines
(anything irregular, including every invalid input), ``UpdateChecker.plan`` runs the
vectorized checks, which accept every valid output and word every error. Both give the
same :class:`UpdatePlan` (the kernel-path tests and the step-oracle tests).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Callable, Sequence

import numpy as np

from attnplug.runner.step.check.snapshot import Deltas, NewReq
from attnplug.runner.step.plan import SpecTokens
from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.step_kernels import StepKernels
from attnplug.runner.step.plan import BlockAppends, ScanBuffers, UpdatePlan
from attnplug.runner.step.request_state import CachedRequestState

PlanNew = Callable[[Sequence[NewReq], Sequence[int]], list[CachedRequestState]]


def plan_update_scanned(lay: StepLayout, batch: InputBatch, kernels: StepKernels, bufs: ScanBuffers,
                        plan_new: PlanNew, so: Deltas, finished: list[str], fin_set: set[str]) -> UpdatePlan | None:
    """Plan ``so`` with the kernels' scans, or return ``None`` (take the vectorized checks).

    Call after ``check_finished_and_new``. Changes nothing.

    Args:
        lay, batch: the step layout and the batch.
        kernels, bufs: the step's kernels and the checker's plan buffers they write.
        plan_new: the numpy check of new requests (``check.new.plan_new_requests`` with
            its packers), for new requests ``scan_new`` declines.

    Raises:
        InvalidSchedulerOutput: a bad new request (the cached part was valid, so this is
            the error the vectorized checks would raise too).
    """
    scan = kernels.scan_cached(batch, lay, bufs, so, finished)
    if scan is None:
        return None
    nst = so.num_scheduled_tokens
    new_reqs = so.scheduled_new_reqs
    C = so.scheduled_cached_reqs.req_ids
    nC, nN = len(C), len(new_reqs)
    if len(nst) != nC + nN or nC + nN > lay.max_num_reqs:
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
    staged = None
    if new_reqs and kernels.scan_new(batch, lay, new_reqs if type(new_reqs) is list else list(new_reqs), new_counts):
        new_states, staged = [], new_reqs
    else:
        new_states = plan_new(new_reqs, new_counts)
    idx = batch.req_id_to_index
    fin_in_batch = sum(1 for rid in finished if rid in idx)
    views = bufs.views
    pre = views.get(nC)
    if pre is None:
        pre = _remember(views, nC, (bufs.rows[:nC], bufs.counts[:nC], bufs.ncts[:nC]))
    rows_c, counts_c, ncts_c = pre
    unscheduled: list[str] = []
    if batch.num_reqs - fin_in_batch > nC:
        mask = np.zeros(lay.max_num_reqs, dtype=bool)
        mask[rows_c] = True
        unscheduled = [rid for rid, r in idx.items() if not mask[r] and rid not in fin_set]
    return UpdatePlan(finished, unscheduled, new_states, new_counts, [], [], rows_c, counts_c,
                      ncts_c, appends=_appends(bufs, scan) if scan.num_appends else None, staged_new=staged,
                      spec_tokens=_spec_tokens(bufs, C, scan.num_spec, scan.spec_total) if scan.num_spec else None)


def _appends(bufs: ScanBuffers, scan) -> BlockAppends | None:
    """The scan's appends as :class:`BlockAppends` (views of ``bufs``; one object per shape,
    made once: its arrays show the buffers' current contents)."""
    m = scan.num_appends
    if m == 0:
        return None
    one_each = scan.one_each
    key = ("appends", m, scan.num_appended, one_each)
    ap = bufs.views.get(key)
    if ap is None:
        ap = _remember(bufs.views, key, BlockAppends(
            bufs.app_sel[:m], bufs.app_start[:, :m], 1 if one_each else bufs.app_len[:, :m],
            bufs.app_after[:, :m], bufs.app_flat[:scan.num_appended], one_each))
    return ap


def _remember(views: dict, key, value):
    """``views[key] = value`` (the cache is emptied first once it holds 1,024 shapes)."""
    if len(views) >= 1024:
        views.clear()
    views[key] = value
    return value


def _spec_tokens(bufs: ScanBuffers, C: list, n: int, total: int) -> SpecTokens | None:
    """The scan's drafts as :class:`SpecTokens` (views of ``bufs``, made once per shape)."""
    if n == 0:
        return None
    if n == len(C):  # every cached request verifies drafts (in cached order)
        ids = C
    else:
        ids = list(itemgetter(*bufs.spec_sel[:n].tolist())(C)) if n > 1 else [C[int(bufs.spec_sel[0])]]
    key = ("spec", n, total)
    v = bufs.views.get(key)
    if v is None:
        v = _remember(bufs.views, key, (bufs.spec_lens[:n], bufs.spec_ids[:total], bufs.spec_rows[:n]))
    return SpecTokens(ids, v[0], v[1], v[2])
