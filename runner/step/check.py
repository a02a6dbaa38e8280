"""``update_states``: validate a ``SchedulerOutput`` in full, then apply it.

Two phases (design notes §1.2), so that a bad output changes nothing:

1. :func:`plan_update` reads the output and the current state, checks every field and
   raises :class:`InvalidSchedulerOutput` naming the request and field at fault. It
   converts the payload into numpy arrays as it goes and returns an :class:`UpdatePlan`.
2. :func:`apply_update` mutates, in this order: drop finished requests (object view AND
   batch), drop unscheduled ones from the batch (their state is kept), add new and
   returning requests (lowest free rows first), merge the cached deltas (rows looked up
   once, counts written with fancy indexing, block appends batched per group;
   ``resumed_from_preemption`` replaces block ids), ``condense()``, then the optional
   decodes-first reorder. Nothing changes rows after that; last, sliding-window groups
   get ``NULL_BLOCK_ID`` over the blocks the pool freed (``runner.step.apply_windows``).

Per-request Python work is limited to what the data structure forces (one dict lookup
per scheduled request, a loop over the few requests that carry token or block payloads);
there is no per-token Python loop.
"""

from __future__ import annotations

import struct
from itertools import chain, compress, repeat
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

from attnplug.cache_groups.ragged import cumsum_and_arange
from attnplug.cache_groups.sliding_window import num_skipped_blocks
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.step.int_packer import INT32_MAX
from attnplug.runner.step.check_fast import plan_update_native
from attnplug.runner.step.check_new import check_block_list, err, group_lists, plan_new_requests
from attnplug.runner.step.scheduler_output import SchedulerOutput
from attnplug.runner.step.apply_windows import null_skipped_blocks
from attnplug.runner.step.plan import BlockAppends, UpdatePlan

if TYPE_CHECKING:
    from attnplug.runner.step.input_batch import InputBatch
    from attnplug.runner.step.compiler import StepCompiler


def _int64s(values, n: int) -> np.ndarray:
    """``n`` Python ints → ``[n]`` ``int64`` with one ``struct`` call (2-3x faster than
    ``np.fromiter`` here). Raises ``struct.error`` / ``TypeError`` for a value that is not
    an int (floats included) or does not fit ``int64``."""
    out = np.empty(n, dtype=np.int64)
    if n:
        struct.pack_into(f"{n}q", out, 0, *values)
    return out


def _int_array(rid, fname: str, g: int, ids) -> np.ndarray:
    try:
        a = np.asarray(ids, dtype=np.int64).reshape(len(ids))
    except (TypeError, ValueError, OverflowError):
        err(rid, fname, f"group {g}: block ids must be a list of ints, got {ids!r}")
    if a.shape[0] and (a.min() < 0 or a.max() > INT32_MAX):
        err(rid, fname, f"group {g}: block ids must be in [0, 2**31), got {a.tolist()}")
    return a.astype(np.int32)


def _counts_slow(nst: dict, C: list, new_reqs, new_ids: set, budget: int) -> tuple[np.ndarray, list[int], int]:
    """``num_scheduled_tokens`` in any order: look every request up, check every value
    (``budget``: ``max_num_batched_tokens``, no single count can exceed it)."""
    def count_of(rid, kind: str) -> int:
        c = nst.get(rid)
        if c is None:
            err(rid, "num_scheduled_tokens", f"{kind} request has no entry")
        if not isinstance(c, (int, np.integer)) or isinstance(c, bool) or c < 1:
            err(rid, "num_scheduled_tokens", f"must be an int >= 1, got {c!r}")
        if c > budget:
            err(rid, "num_scheduled_tokens", f"{c} tokens but max_num_batched_tokens is {budget}")
        return int(c)

    counts = [count_of(rid, "scheduled cached") for rid in C]
    new_counts = [count_of(nr.req_id, "new") for nr in new_reqs]
    if len(nst) != len(C) + len(new_reqs):
        known = set(C) | new_ids
        err(next(r for r in nst if r not in known), "num_scheduled_tokens",
            "request is in neither scheduled_new_reqs nor scheduled_cached_reqs")
    return np.asarray(counts, dtype=np.int64).reshape(len(C)), new_counts, sum(counts) + sum(new_counts)


def _check_not_behind_nulled(sc: "StepCompiler", C: list, rows_c: np.ndarray, ncts_c: np.ndarray,
                             resumed: set[int]) -> None:
    """A non-resumed cached request must not schedule positions in sliding-window blocks the
    runner already nulled (its ``num_computed_tokens`` went back without a preemption)."""
    done = sc.input_batch.num_computed_tokens_nulled[rows_c]  # rows_c -1 (re-added rows): masked below
    if not (ncts_c < done).any():  # the common case: nobody went back
        return
    check = rows_c >= 0
    if resumed:
        check[list(resumed)] = False
    for g, window in enumerate(sc.sliding_windows):
        if window is None:
            continue
        B = sc.block_sizes[g]
        bad = check & (num_skipped_blocks(done, window, B) > ncts_c // B)
        if bad.any():
            i = int(np.argmax(bad))
            err(C[i], "num_computed_tokens", f"group {g}: {int(ncts_c[i])} is behind the sliding window the "
                f"runner already applied ({int(done[i])} tokens computed, window {window}): its first "
                "blocks were freed and nulled; a request that recomputes must be resumed_from_preemption "
                "with fresh block ids")


def _check_span_not_null(sc: "StepCompiler", C: list, rows_c: np.ndarray, ncts_c: np.ndarray, seq_c: np.ndarray,
                         before: np.ndarray, readd: list[int], resumed: set[int]) -> None:
    """No scheduled position of a cached request may fall in a ``NULL_BLOCK_ID`` its row
    already holds (a sliding-window group's skipped prefix, sent by the scheduler or
    nulled by the runner): a request that goes back to recompute must be resumed with
    fresh blocks. Appended blocks are never null (checked with the appends); resumed
    requests' fresh lists are checked with ``check_block_list``."""
    batch = sc.input_batch
    for g, allowed in enumerate(sc.null_block_allowed):
        if not allowed:
            continue
        B = sc.block_sizes[g]
        first = ncts_c // B
        cnt = np.minimum((seq_c - 1) // B, before[g].astype(np.int64) - 1) - first + 1
        np.maximum(cnt, 0, out=cnt)
        cnt[rows_c < 0] = 0  # re-added rows: checked below from their state
        if resumed:
            cnt[list(resumed)] = 0
        bad = None
        if cnt.any():
            _, offs = cumsum_and_arange(cnt)
            owner = np.repeat(np.arange(cnt.shape[0]), cnt)
            hit = batch.block_table[g].block_table_np[rows_c[owner], first[owner] + offs] == NULL_BLOCK_ID
            if hit.any():
                bad = int(owner[np.argmax(hit)])
        for i in readd:
            if bad is None and i not in resumed:
                ids = sc.requests[C[i]].block_ids_np()[g]
                if (ids[int(first[i]):(int(seq_c[i]) - 1) // B + 1] == NULL_BLOCK_ID).any():
                    bad = i
        if bad is not None:
            err(C[bad], "num_computed_tokens", f"group {g}: positions [{int(ncts_c[bad])}, {int(seq_c[bad])}) fall "
                "in the null block (a skipped sliding-window prefix); a request that recomputes must be "
                "resumed_from_preemption with fresh block ids")


def check_finished_and_new(sc: "StepCompiler", so: SchedulerOutput) -> tuple[list[str], set[str], set[str]]:
    """The checks both planning paths run first: container shapes, finished ids, new ids.

    Returns:
        ``(finished, fin_set, new_ids)``: finished ids deduplicated in order, as a set,
        and the new requests' ids.
    """
    reqs = sc.requests
    nst = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    nC = len(cached.req_ids)
    if not isinstance(nst, dict):
        err(None, "num_scheduled_tokens", f"expected a dict {{req_id: int}}, got {type(nst).__name__}")
    for name in ("resumed_from_preemption", "new_token_ids", "new_block_ids", "num_computed_tokens"):
        if len(getattr(cached, name)) != nC:
            err(None, f"scheduled_cached_reqs.{name}", f"has {len(getattr(cached, name))} entries for "
                f"{nC} req_ids: every list needs one entry per cached request")

    # --- finished and new ids -------------------------------------------------------------
    finished = list(dict.fromkeys(so.finished_req_ids))
    fin_set = set(finished)
    for rid in finished:
        if rid not in reqs:
            err(rid, "finished_req_ids", "unknown request: the runner never held it or already dropped it")
    new_reqs = so.scheduled_new_reqs
    new_ids: set[str] = set()
    for nr in new_reqs:
        rid = nr.req_id
        if rid in reqs and rid not in fin_set:
            err(rid, "scheduled_new_reqs", "request is already resident: send it in scheduled_cached_reqs "
                "(or finish it in the same step to restart it)")
        if rid in new_ids:
            err(rid, "scheduled_new_reqs", "request listed twice")
        new_ids.add(rid)
    return finished, fin_set, new_ids


def plan_update(sc: "StepCompiler", so: SchedulerOutput) -> UpdatePlan:
    """Validate ``so`` against the compiler's state; change nothing.

    Takes the compiled fast path (``runner.step.check_fast``) when it is available and
    the output is regular; this numpy path otherwise.

    Raises:
        InvalidSchedulerOutput: the first problem found, with its request id and field.
    """
    finished, fin_set, new_ids = check_finished_and_new(sc, so)
    if sc._cached_scan is not None:
        plan = plan_update_native(sc, so, finished, fin_set)
        if plan is not None:
            return plan
    batch, reqs = sc.input_batch, sc.requests
    idx = batch.req_id_to_index
    nst = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    C = cached.req_ids
    nC = len(C)
    new_reqs = so.scheduled_new_reqs

    # --- cached request rows (one dict lookup each) ------------------------------------------
    try:  # itemgetter looks all ids up in one C call (it returns a bare value for one id)
        rows_c = _int64s(itemgetter(*C)(idx), nC) if nC > 1 else np.fromiter(map(idx.__getitem__, C), np.int64, nC)
        readd = []
    except KeyError:  # some are resident but not in the batch (or unknown): look them up again
        rows_c = np.fromiter(map(idx.get, C, repeat(-1)), np.int64, nC)
        readd = np.flatnonzero(rows_c < 0).tolist()
    except TypeError:
        err(None, "scheduled_cached_reqs.req_ids", "request ids must be hashable strings")
    readd_ids: list[str] = []
    for i in readd:
        rid = C[i]
        if rid not in reqs or rid in readd_ids:
            err(rid, "scheduled_cached_reqs", "request listed twice" if rid in readd_ids else
                "unknown request: send it in scheduled_new_reqs first")
        if rid in fin_set:
            err(rid, "finished_req_ids", "request is both finished and scheduled in this step")
        readd_ids.append(rid)
    present = rows_c[rows_c >= 0] if readd else rows_c
    sched_mask = np.zeros(sc.max_num_reqs, dtype=bool)
    sched_mask[present] = True
    if np.count_nonzero(sched_mask) != present.shape[0]:
        err(batch._req_ids[int(np.argmax(np.bincount(present)))], "scheduled_cached_reqs", "request listed twice")
    fin_in_batch = 0
    for rid in finished:
        r = idx.get(rid)
        if r is not None:
            if sched_mask[r]:
                err(rid, "finished_req_ids", "request is both finished and scheduled in this step")
            fin_in_batch += 1

    # --- num_scheduled_tokens ----------------------------------------------------------------
    nN = len(new_reqs)
    keys = list(nst)
    try:
        total = sum(nst.values())
    except TypeError:
        total = None
    vals = None
    if type(total) is int and len(keys) == nC + nN and keys[:nC] == C and (
            not nN or keys[nC:] == [nr.req_id for nr in new_reqs]):
        # fast path: the dict lists cached then new requests in delta order (as schedulers do)
        try:
            vals = _int64s(nst.values(), nC + nN)
        except struct.error:  # an int beyond int64: the checked slow path words it
            vals = None
    if vals is not None:
        counts_c = vals[:nC]
        new_counts = vals[nC:].tolist()
    else:
        counts_c, new_counts, total = _counts_slow(nst, C, new_reqs, new_ids, sc.max_num_batched_tokens)
        vals = counts_c
    if vals.shape[0] and np.count_nonzero(vals < 1):
        bad = next(r for r in [*C, *(nr.req_id for nr in new_reqs)] if nst[r] < 1)
        err(bad, "num_scheduled_tokens", f"must be >= 1, got {nst[bad]!r}")
    if total > sc.max_num_batched_tokens:
        err(None, "num_scheduled_tokens", f"{total} tokens scheduled but max_num_batched_tokens is "
            f"{sc.max_num_batched_tokens}: the scheduler's token budget must not exceed the runner's")
    if so.total_num_scheduled_tokens != total:
        err(None, "total_num_scheduled_tokens", f"is {so.total_num_scheduled_tokens} but the entries of "
            f"num_scheduled_tokens sum to {total}")
    if nC + nN > sc.max_num_reqs:
        err(None, "num_scheduled_tokens", f"{nC + nN} requests scheduled but the batch holds at most "
            f"max_num_reqs={sc.max_num_reqs}")

    # --- num_computed_tokens and token deltas --------------------------------------------------
    ncts_list = cached.num_computed_tokens
    try:  # converts and type-checks in one pass: struct rejects floats, strings, None
        ncts_c = _int64s(ncts_list, nC)
    except (struct.error, TypeError, ValueError, OverflowError):
        bad = next((i for i, v in enumerate(ncts_list) if not isinstance(v, (int, np.integer))
                    or isinstance(v, bool)), None)
        if bad is not None:
            err(C[bad], "num_computed_tokens", f"must be an int, got {ncts_list[bad]!r}")
        bad = next(i for i, v in enumerate(ncts_list) if not -2**63 <= v < 2**63)
        err(C[bad], "num_computed_tokens", f"{ncts_list[bad]} is out of range")
    held_c = batch.num_tokens[rows_c]
    for i in readd:
        held_c[i] = reqs[C[i]].num_tokens
    token_deltas: list[tuple[int, np.ndarray]] = []
    try:
        has_tokens = cached.new_token_ids.count([]) != nC
    except (TypeError, ValueError):  # numpy entries
        has_tokens = True
    if has_tokens:
        held_c = held_c.astype(np.int64)
        for i, t in enumerate(cached.new_token_ids):
            if not isinstance(t, (list, tuple, np.ndarray)):
                err(C[i], "new_token_ids", f"expected a list of token ids (empty for none), got {t!r}")
        tok_idx = [i for i, t in enumerate(cached.new_token_ids) if len(t)]
        packed = sc._delta_packer.pack([cached.new_token_ids[i] for i in tok_idx])
        if isinstance(packed, int):
            err(C[tok_idx[packed]], "new_token_ids", "token ids must be ints in [0, 2**31)")
        for i, arr in zip(tok_idx, packed):
            held_c[i] += arr.shape[0]
            token_deltas.append((i, arr))
        if tok_idx and held_c.max() > sc.max_model_len:
            i = int(np.argmax(held_c))
            err(C[i], "new_token_ids", f"request would hold {int(held_c[i])} tokens but max_model_len is "
                f"{sc.max_model_len}")
    seq_c = ncts_c + counts_c
    if nC and (np.count_nonzero(ncts_c < 0) or np.count_nonzero(seq_c > held_c)):
        i = int(np.argmax((ncts_c < 0) | (seq_c > held_c)))
        if not 0 <= ncts_c[i] <= held_c[i]:
            err(C[i], "num_computed_tokens", f"{int(ncts_c[i])} is not in [0, {int(held_c[i])}] (the "
                "tokens the request holds)")
        err(C[i], "num_scheduled_tokens", f"schedules positions [{int(ncts_c[i])}, {int(seq_c[i])}) but the "
            f"request holds only {int(held_c[i])} tokens (send new tokens in new_token_ids)")

    # --- block deltas (all groups at once: [num_groups, num_cached] arrays) ---------------------
    G = sc.num_groups
    nb = cached.new_block_ids
    resumed: list[tuple[int, tuple[np.ndarray, ...]]] = []
    if any(cached.resumed_from_preemption):
        for i, flag in enumerate(cached.resumed_from_preemption):
            if flag:
                groups = [[]] * G if nb[i] is None else group_lists(sc, C[i], "new_block_ids", nb[i])
                arrs = tuple(_int_array(C[i], "new_block_ids", g, ids) for g, ids in enumerate(groups))
                for g, a in enumerate(arrs):
                    check_block_list(sc, C[i], "new_block_ids", g, a, int(ncts_c[i]), int(seq_c[i]))
                resumed.append((i, arrs))
    # np.take along axis 1: 2-D fancy indexing with a leading slice is ~5x slower
    before = batch.block_table.num_blocks_per_row.take(rows_c, axis=1)
    for i in readd:
        before[:, i] = [a.shape[0] for a in reqs[C[i]].block_ids_np()]
    for i, arrs in resumed:
        before[:, i] = [a.shape[0] for a in arrs]
    if nC and sc.has_sliding_windows:
        _check_not_behind_nulled(sc, C, rows_c, ncts_c, {i for i, _ in resumed})
    if nC and any(sc.null_block_allowed):
        _check_span_not_null(sc, C, rows_c, ncts_c, seq_c, before, readd, {i for i, _ in resumed})
    try:
        sel = list(compress(range(nC), nb))
    except (ValueError, TypeError):  # an entry that is neither None nor a tuple/list (e.g. an array)
        i = next(i for i, e in enumerate(nb) if e is not None and not isinstance(e, (tuple, list)))
        group_lists(sc, C[i], "new_block_ids", nb[i])
    if resumed:
        skip = {i for i, _ in resumed}
        sel = [i for i in sel if i not in skip]
    appends = None
    if sel:
        entries = [nb[i] for i in sel]
        for e, i in zip(entries, sel):
            if not isinstance(e, (tuple, list)) or len(e) != G:
                group_lists(sc, C[i], "new_block_ids", e)
        per = [e[g] for g in range(G) for e in entries]  # group-major
        m = len(sel)
        for j, p in enumerate(per):
            if not isinstance(p, (list, tuple, np.ndarray)):
                err(C[sel[j % m]], "new_block_ids", f"group {j // m}: expected a list of block ids, got {p!r}")
        lens_list = [len(p) for p in per]
        one_each = lens_list.count(1) == G * m  # the decode case: one new block per group
        try:
            flat = np.fromiter(chain.from_iterable(per), np.int64, sum(lens_list))
        except (TypeError, ValueError, OverflowError):
            j = next(j for j, p in enumerate(per) if not all(
                isinstance(b, (int, np.integer)) and not isinstance(b, bool) and -2**63 <= b < 2**63 for b in p))
            err(C[sel[j % m]], "new_block_ids", f"group {j // m}: block ids must be ints in "
                f"[{NULL_BLOCK_ID + 1}, {sc.num_blocks_per_group[j // m]})")
        if np.count_nonzero(flat <= NULL_BLOCK_ID) or np.count_nonzero(flat >= sc.num_blocks):
            per_group_len = np.add.reduceat(np.asarray(lens_list, dtype=np.int64), np.arange(0, G * m, m)) \
                if m else np.zeros(G, dtype=np.int64)
            bound = np.repeat(np.asarray(sc.num_blocks_per_group, dtype=np.int64), per_group_len)
            bad = (flat <= NULL_BLOCK_ID) | (flat >= bound)
            if bad.any():
                t = int(np.argmax(bad))
                j = int(np.searchsorted(np.cumsum(lens_list), t, side="right"))
                err(C[sel[j % m]], "new_block_ids", f"group {j // m}: appended block id {int(flat[t])} is not in "
                    f"[{NULL_BLOCK_ID + 1}, {sc.num_blocks_per_group[j // m]}): a newly appended block is never "
                    "the null block and must lie in the pool")
        sel_arr = np.asarray(sel, dtype=np.int64)
        starts = before.take(sel_arr, axis=1)
        lens = 1 if one_each else np.asarray(lens_list, dtype=np.int64).reshape(G, m)
        after = starts + lens
        if np.count_nonzero(after > sc._max_blocks_col):
            g, j = np.argwhere(after > sc._max_blocks_col)[0]
            err(C[sel[j]], "new_block_ids", f"group {g}: request would hold {int(after[g, j])} blocks but at "
                f"most {sc.max_num_blocks_per_req[g]} fit (cdiv(max_model_len, block_size))")
        before[:, sel_arr] = after
        appends = BlockAppends(sel_arr, starts, lens, after, flat, one_each)
    if nC and np.count_nonzero(before * sc._capacity_col < seq_c):
        g, i = np.argwhere(before * sc._capacity_col < seq_c)[0]
        err(C[i], "new_block_ids", f"group {g}: {int(before[g, i])} blocks of {sc.block_sizes[g]} tokens "
            f"cannot hold seq_len {int(seq_c[i])}; the block table is too short")

    new_states = plan_new_requests(sc, new_reqs, new_counts)
    unscheduled: list[str] = []
    if batch.num_reqs - fin_in_batch > present.shape[0]:
        unscheduled = [rid for rid, r in idx.items() if not sched_mask[r] and rid not in fin_set]
    return UpdatePlan(finished, unscheduled, new_states, new_counts, readd_ids, readd, rows_c, counts_c,
                      ncts_c, token_deltas, resumed, appends)


def apply_update(sc: "StepCompiler", plan: UpdatePlan) -> None:
    """Apply a validated plan (see the module docstring for the order)."""
    batch, reqs = sc.input_batch, sc.requests
    batch.remove_requests(plan.finished, keep_state=False)
    for rid in plan.finished:
        del reqs[rid]
    if plan.unscheduled:
        batch.remove_requests(plan.unscheduled)
    for st in plan.new_states:
        reqs[st.req_id] = st
    if plan.new_scanned is not None:  # compiled path: rows written from NewScan's staging
        batch.admit_scanned(plan.new_scanned, sc._new_scan, reqs)
    states = plan.new_states + [reqs[rid] for rid in plan.readd_ids] if plan.readd_ids else plan.new_states
    rows = batch.add_requests(states)
    rows_c = plan.rows_c
    n_new = len(plan.new_states)
    if plan.readd:
        rows_c[plan.readd] = rows[n_new:]
    sched = batch.num_scheduled_tokens
    for row, c in zip(rows, plan.new_counts):
        sched[row] = c
    if plan.native:
        sc._cached_scan.apply()
    else:
        _merge_cached(batch, plan, rows_c)
    batch.condense()
    if sc.reorder_batch_threshold is not None:
        reorder_decodes_first(batch, sc.reorder_batch_threshold)
    if sc.has_sliding_windows:
        null_skipped_blocks(batch, sc.sliding_windows)


def _merge_cached(batch: "InputBatch", plan: UpdatePlan, rows_c: np.ndarray) -> None:
    """The numpy path's merge of the cached requests' deltas into their rows."""
    sched = batch.num_scheduled_tokens
    batch.num_computed_tokens_cpu[rows_c] = plan.ncts_c
    sched[rows_c] = plan.counts_c
    toks, n_tok = batch.token_ids_cpu, batch.num_tokens
    for i, arr in plan.token_deltas:
        r = rows_c[i]
        n = n_tok[r]
        toks[r, n:n + arr.shape[0]] = arr
        n_tok[r] = n + arr.shape[0]
    for i, arrs in plan.resumed:
        batch.block_table.add_row(arrs, int(rows_c[i]))
        batch.num_computed_tokens_nulled[rows_c[i]] = 0  # fresh blocks: nothing nulled yet
    if plan.appends is not None:
        ap = plan.appends
        rows = rows_c[ap.sel]
        m = rows.shape[0]
        if ap.one_each:  # one new block per row and group (decode crossing a block boundary)
            for g, bt in enumerate(batch.block_table):
                bt.write_blocks(rows, ap.starts[g], ap.flat[g * m:(g + 1) * m])
        else:
            off = 0
            for g, bt in enumerate(batch.block_table):
                lens = ap.lens[g]
                _, offsets = cumsum_and_arange(lens)
                n = offsets.shape[0]
                bt.write_blocks(np.repeat(rows, lens), np.repeat(ap.starts[g], lens) + offsets,
                                ap.flat[off:off + n])
                off += n
        for counts, after in zip(batch.block_table.num_blocks_per_row, ap.after):
            counts[rows] = after


def reorder_decodes_first(batch: "InputBatch", threshold: int) -> list[tuple[int, int]]:
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
