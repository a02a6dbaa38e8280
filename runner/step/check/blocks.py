"""Stage 1, block deltas of cached requests: replacements (resumed), appends, capacity.

All groups at once: ``[num_groups, num_cached]`` arrays of the blocks each row holds
before and after the step, checked against the pools, the table width and ``seq_lens``.
"""

from __future__ import annotations

from itertools import chain, compress

import numpy as np

from attnplug.cache_groups.ragged import cumsum_and_arange
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.step.check.lists import (
    block_id_array,
    check_block_list,
    err,
    group_lists,
    repeated_block,
    repeated_block_message,
    repeated_pair,
)
from attnplug.runner.step.check.snapshot import CachedDeltas
from attnplug.runner.step.check.types import int64_list, is_flag, is_int_list, show
from attnplug.runner.step.check.windows import check_not_behind_nulled, check_span_not_null
from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.plan import BlockAppends
from attnplug.runner.step.request_state import CachedRequestState

Resumed = list[tuple[int, tuple[np.ndarray, ...]]]


def resumed_lists(lay: StepLayout, cached: CachedDeltas, ncts_c: np.ndarray, seq_c: np.ndarray) -> Resumed:
    """The replacement block lists of the ``resumed_from_preemption`` requests, checked
    as initial lists are (``check_block_list``)."""
    resumed: Resumed = []
    C, nb, G = cached.req_ids, cached.new_block_ids, lay.num_groups
    flags = cached.resumed_from_preemption
    if not set(map(type, flags)) <= {bool, np.bool_}:  # any truthy value would replace the blocks
        i = next(i for i, f in enumerate(flags) if not is_flag(f))
        err(C[i], "resumed_from_preemption", f"must be a bool, got {show(flags[i])}")
    if not any(flags):
        return resumed
    for i, flag in enumerate(flags):
        if flag:
            groups = [[]] * G if nb[i] is None else group_lists(lay, C[i], "new_block_ids", nb[i])
            arrs = tuple(block_id_array(C[i], "new_block_ids", g, ids) for g, ids in enumerate(groups))
            for g, a in enumerate(arrs):
                check_block_list(lay, C[i], "new_block_ids", g, a, int(ncts_c[i]), int(seq_c[i]))
                dup = repeated_block(a, [a.shape[0]])
                if dup is not None:
                    err(C[i], "new_block_ids", repeated_block_message(g, dup[1]))
            resumed.append((i, arrs))
    return resumed


def block_appends(lay: StepLayout, cached: CachedDeltas, sel: list[int], before: np.ndarray) -> BlockAppends:
    """The appended block ids of requests ``sel`` (indices into the cached requests):
    one list per group each, ids in the pool and never null, rows not overfull.
    Updates ``before`` (the ``[G, num_cached]`` counts) to the counts after the append."""
    C, nb, G = cached.req_ids, cached.new_block_ids, lay.num_groups
    entries = [nb[i] for i in sel]
    for e, i in zip(entries, sel):
        if not isinstance(e, (tuple, list)) or len(e) != G:
            group_lists(lay, C[i], "new_block_ids", e)
    per = [e[g] for g in range(G) for e in entries]  # group-major
    m = len(sel)
    for j, p in enumerate(per):
        if not is_int_list(p):
            err(C[sel[j % m]], "new_block_ids", f"group {j // m}: expected a list of block ids (or a 1-D "
                f"integer array), got {show(p)}")
    lens_list = [len(p) for p in per]
    one_each = lens_list.count(1) == G * m  # the decode case: one new block per group
    flat = int64_list(list(chain.from_iterable(per)))
    if flat is None:
        j = next(j for j, p in enumerate(per) if int64_list(list(p)) is None)
        err(C[sel[j % m]], "new_block_ids", f"group {j // m}: block ids must be ints in "
            f"[{NULL_BLOCK_ID + 1}, {lay.num_blocks_per_group[j // m]}), got {show(per[j])}")
    if np.count_nonzero(flat <= NULL_BLOCK_ID) or np.count_nonzero(flat >= lay.num_blocks):
        per_group_len = np.add.reduceat(np.asarray(lens_list, dtype=np.int64), np.arange(0, G * m, m)) \
            if m else np.zeros(G, dtype=np.int64)
        bound = np.repeat(np.asarray(lay.num_blocks_per_group, dtype=np.int64), per_group_len)
        bad = (flat <= NULL_BLOCK_ID) | (flat >= bound)
        if bad.any():
            t = int(np.argmax(bad))
            j = int(np.searchsorted(np.cumsum(lens_list), t, side="right"))
            err(C[sel[j % m]], "new_block_ids", f"group {j // m}: appended block id {int(flat[t])} is not in "
                f"[{NULL_BLOCK_ID + 1}, {lay.num_blocks_per_group[j // m]}): a newly appended block is never "
                "the null block and must lie in the pool")
    sel_arr = np.asarray(sel, dtype=np.int64)
    starts = before.take(sel_arr, axis=1)
    lens = 1 if one_each else np.asarray(lens_list, dtype=np.int64).reshape(G, m)
    after = starts + lens
    if np.count_nonzero(after > lay.max_blocks_col):
        g, j = np.argwhere(after > lay.max_blocks_col)[0]
        err(C[sel[j]], "new_block_ids", f"group {g}: request would hold {int(after[g, j])} blocks but at "
            f"most {lay.max_num_blocks_per_req[g]} fit (cdiv(max_model_len, block_size))")
    before[:, sel_arr] = after
    return BlockAppends(sel_arr, starts, lens, after, flat, one_each)


def check_appends_distinct(lay: StepLayout, batch: InputBatch, reqs: dict[str, CachedRequestState], C: list,
                           rows_c: np.ndarray, ap: BlockAppends) -> None:
    """No appended block id repeats one in its own list or one its row already holds (per
    group); re-added rows (``rows_c`` -1) are read from their state.

    A row's held ids are read only when one of its appended ids is at or below the row's
    ``block_id_bound`` (``cache_groups/block_table.py``: at least its largest held id), as
    the compiled scan does: a pool that hands out growing ids never needs the read.

    Cost: the decode case (one block per row and group) compares each such new id with
    its row's held ids (one gather); otherwise one sort of those rows' ids and the new
    ones (or, with no such row, one compare of the new lists, ``repeated_block``)."""
    m = ap.sel.shape[0]
    rows = rows_c[ap.sel]
    if _MIN(rows) >= 0 and _above_bounds(lay, batch, rows, ap):  # no row can hold its new ids
        if not ap.one_each:  # the new lists alone, all groups at once (group-major: lowest group first)
            dup = repeated_block(ap.flat, ap.lens.ravel())
            if dup is not None:
                err(C[int(ap.sel[dup[0] % m])], "new_block_ids", repeated_block_message(dup[0] // m, dup[1]))
        return
    readd = np.flatnonzero(rows < 0).tolist()
    safe_rows = np.maximum(rows, 0)
    off = 0
    for g in range(lay.num_groups):
        table = batch.block_table[g].block_table_np
        bound = batch.block_table.block_id_bound[g].take(safe_rows)
        found = None
        if ap.one_each:
            starts = ap.starts[g]
            new = ap.flat[off:off + m]
            off += m
            near = new <= bound  # only these rows may hold their new id
            near[readd] = False  # (read from their state below)
            cand = np.flatnonzero(near)
            width = int(starts[cand].max()) if cand.shape[0] else 0
            # a row's columns past its held blocks are NULL_BLOCK_ID, which no appended id
            # is: mask by the held count only after a raw hit
            hit = (table[safe_rows[cand], :width] == new[cand, None]) if width else None
            if hit is not None and hit.any():
                hit &= np.arange(width) < starts[cand, None]
                if hit.any():
                    j = int(cand[np.argmax(hit.any(axis=1))])
                    found = (j, int(new[j]))
        else:
            starts = ap.starts[g].astype(np.int64)
            lens = ap.lens[g]
            n = int(lens.sum())
            new = ap.flat[off:off + n]
            off += n
            new_owner = np.repeat(np.arange(m, dtype=np.int64), lens)
            near = np.zeros(m, dtype=bool)
            near[new_owner[new <= bound[new_owner]]] = True
            near[readd] = False
            if not readd and not near.any():  # the new lists alone
                found = repeated_block(new, lens)
            else:
                held = np.where(near, starts, 0)
                _, cols = cumsum_and_arange(held)
                owner = np.repeat(np.arange(m, dtype=np.int64), held)
                parts_o = [owner, new_owner]
                parts_i = [table[safe_rows[owner], cols].astype(np.int64), new.astype(np.int64)]
                for j in readd:
                    ids = reqs[C[int(ap.sel[j])]].block_ids_np()[g]
                    parts_o.append(np.full(ids.shape[0], j, dtype=np.int64))
                    parts_i.append(ids.astype(np.int64))
                found = repeated_pair(np.concatenate(parts_o), np.concatenate(parts_i))
        for j in readd:  # the decode case's re-added rows
            if found is None and ap.one_each:
                if (reqs[C[int(ap.sel[j])]].block_ids_np()[g] == new[j]).any():
                    found = (j, int(new[j]))
        if found is not None:
            err(C[int(ap.sel[found[0]])], "new_block_ids", repeated_block_message(g, found[1]))


def _above_bounds(lay: StepLayout, batch: InputBatch, rows: np.ndarray, ap: BlockAppends) -> bool:
    """Every appended id lies above its row's ``block_id_bound`` in its group (rows all in
    the batch): no row holds one of its new ids (a pool handing out growing ids)."""
    bounds = batch.block_table.block_id_bound.take(rows, axis=1)  # [G, m]
    if ap.one_each:
        return bool(_ALL(ap.flat.reshape(bounds.shape) > bounds, axis=None))
    return bool(_ALL(ap.flat > np.repeat(bounds.ravel(), ap.lens.ravel())))


_MIN = np.minimum.reduce
_ALL = np.logical_and.reduce  # (ndarray.min / .all without their Python wrappers)


def block_deltas(lay: StepLayout, batch: InputBatch, reqs: dict[str, CachedRequestState], cached: CachedDeltas,
                 rows_c: np.ndarray, readd: list[int], ncts_c: np.ndarray, seq_c: np.ndarray
                 ) -> tuple[Resumed, BlockAppends | None]:
    """The cached requests' ``new_block_ids``: replacements, appends, windows, capacity.

    Returns:
        ``(resumed, appends)``: the replacement lists per resumed request, and the
        appends of the others (``None`` when there are none).
    """
    C, nb = cached.req_ids, cached.new_block_ids
    nC = len(C)
    resumed = resumed_lists(lay, cached, ncts_c, seq_c)
    # np.take along axis 1: 2-D fancy indexing with a leading slice is ~5x slower
    before = batch.block_table.num_blocks_per_row.take(rows_c, axis=1)
    for i in readd:
        before[:, i] = [a.shape[0] for a in reqs[C[i]].block_ids_np()]
    for i, arrs in resumed:
        before[:, i] = [a.shape[0] for a in arrs]
    if nC and lay.has_sliding_windows:
        check_not_behind_nulled(lay, batch, C, rows_c, ncts_c, {i for i, _ in resumed})
    if nC and any(lay.null_block_allowed):
        check_span_not_null(lay, batch, reqs, C, rows_c, ncts_c, seq_c, before, readd, {i for i, _ in resumed})
    try:
        sel = list(compress(range(nC), nb))
    except (ValueError, TypeError):  # an entry that is neither None nor a tuple/list (e.g. an array)
        i = next(i for i, e in enumerate(nb) if e is not None and not isinstance(e, (tuple, list)))
        group_lists(lay, C[i], "new_block_ids", nb[i])
    if resumed:
        skip = {i for i, _ in resumed}
        sel = [i for i in sel if i not in skip]
    appends = block_appends(lay, cached, sel, before) if sel else None
    if appends is not None:
        check_appends_distinct(lay, batch, reqs, C, rows_c, appends)
    if nC and np.count_nonzero(before * lay.capacity_col < seq_c):
        g, i = np.argwhere(before * lay.capacity_col < seq_c)[0]
        err(C[i], "new_block_ids", f"group {g}: {int(before[g, i])} blocks of {lay.block_sizes[g]} tokens "
            f"cannot hold seq_len {int(seq_c[i])}; the block table is too short")
    return resumed, appends
