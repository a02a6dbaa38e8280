"""Stage 2 of a step: apply a checked ``UpdatePlan`` to both views of the state.

:func:`apply_update` mutates, in this order: drop finished requests (object view AND
batch), drop unscheduled ones from the batch (their state is kept), add new and
returning requests (lowest free rows first), merge the cached deltas (the kernels'
``merge_cached``: counts, token deltas, block appends;
``resumed_from_preemption`` replaces block ids), ``condense()``, then the optional
decodes-first reorder. Nothing changes rows after that; last, sliding-window groups get
``NULL_BLOCK_ID`` over the blocks the pool freed (the kernels' ``null_skipped``:
``runner/step/apply_windows.py``), and
the step's draft tokens go after their rows' tokens (``runner/step/spec_apply.py``).
Every row move ends here, before stage 3 (``runner/step/prepare.py``) reads the rows.
"""

from __future__ import annotations

import numpy as np

from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.plan import UpdatePlan
from attnplug.runner.step.spec_apply import write_spec_tokens
from attnplug.runner.step.request_state import CachedRequestState


def apply_update(lay: StepLayout, batch: InputBatch, reqs: dict[str, CachedRequestState], plan: UpdatePlan,
                 reorder_batch_threshold: int | None = None) -> None:
    """Apply a plan from stage 1 (see the module docstring for the order).

    Args:
        lay: the step layout (windows).
        batch, reqs: the two views of the state, changed in place.
        plan: what :meth:`UpdateChecker.plan` returned for this step's output.
        reorder_batch_threshold: if set, decodes (rows with ``num_scheduled_tokens <=
            threshold``) are moved before the others.
    """
    batch.remove_requests(plan.finished, keep_state=False)
    for rid in plan.finished:
        del reqs[rid]
    if plan.unscheduled:
        batch.remove_requests(plan.unscheduled)
    for st in plan.new_states:
        reqs[st.req_id] = st
    if plan.staged_new is not None:  # rows written from the kernels' staging
        batch.admit_staged(plan.staged_new, lay, reqs)
    states = plan.new_states + [reqs[rid] for rid in plan.readd_ids] if plan.readd_ids else plan.new_states
    rows = batch.add_requests(states)
    rows_c = plan.rows_c
    n_new = len(plan.new_states)
    if plan.readd:
        rows_c[plan.readd] = rows[n_new:]
    sched = batch.num_scheduled_tokens
    for row, c in zip(rows, plan.new_counts):
        sched[row] = c
    batch.kernels.merge_cached(batch, plan, rows_c)
    moved = batch.condense()
    if reorder_batch_threshold is not None:
        moved += reorder_decodes_first(batch, reorder_batch_threshold)
    if lay.has_sliding_windows:
        batch.kernels.null_skipped(batch, lay.sliding_windows)
    if plan.spec_tokens is not None or batch.drafts_written:
        write_spec_tokens(batch, plan.spec_tokens, rows_moved=bool(moved))


def reorder_decodes_first(batch: InputBatch, threshold: int) -> list[tuple[int, int]]:
    """Put rows with ``num_scheduled_tokens <= threshold`` (decodes) before the others.

    Pairs the first misplaced prefill with the last misplaced decode and swaps each pair
    (vLLM's ``reorder_batch_to_split_decodes_and_prefills``). Returns the swaps.
    """
    R = batch.num_reqs
    is_dec = batch.num_scheduled_tokens[:R] <= threshold
    d = int(np.count_nonzero(is_dec))
    if d == 0 or d == R or is_dec[:d].all():
        return []
    front = np.flatnonzero(~is_dec[:d])
    back = (np.flatnonzero(is_dec[d:]) + d)[::-1]
    swaps = list(zip(front.tolist(), back.tolist()))
    for a, b in swaps:
        batch.swap_states(a, b)
    return swaps
