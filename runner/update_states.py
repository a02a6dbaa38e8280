"""``update_states``: validate a ``SchedulerOutput`` in full, then apply it.

Two phases (design notes §1.2), so that a bad output changes nothing:

1. :func:`plan_update` reads the output and the current state, checks every field and
   raises :class:`InvalidSchedulerOutput` naming the request and field at fault. It
   converts the payload into numpy arrays as it goes and returns an :class:`UpdatePlan`.
2. :func:`apply_update` mutates, in this order: drop finished requests (object view AND
   batch), drop unscheduled ones from the batch (their state is kept), add new and
   returning requests (lowest free rows first), merge the cached deltas (vectorized:
   rows looked up once, counts written with fancy indexing, block appends batched per
   group; ``resumed_from_preemption`` replaces block ids), ``condense()``, then the
   optional decodes-first reorder. Nothing changes rows after that.

Per-request Python work is limited to what the data structure forces (one dict lookup
per scheduled request, a loop over the few requests that carry token or block payloads);
there is no per-token Python loop.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

import numpy as np

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.request_state import CachedRequestState
from attnplug.runner.scheduler_output import SamplingParams, SchedulerOutput

if TYPE_CHECKING:
    from attnplug.runner.step_compiler import StepCompiler

_INT32_MAX = 2**31 - 1


def _err(req_id: Any, field_name: str, message: str) -> NoReturn:
    raise InvalidSchedulerOutput(req_id, field_name, message)


class IntPacker:
    """Packs int sequences into one reusable ``int32`` buffer (``struct``, ~10 ns per int,
    about twice as fast as ``np.array(list)``). Returned views are valid until the next
    ``pack`` call."""

    def __init__(self, capacity: int = 1 << 16):
        self._buf = np.empty(capacity, dtype=np.int32)

    def pack(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray] | int:
        """Pack ``seqs``; return one ``int32`` view per sequence, or the index of the first
        sequence holding a value that is not an int in ``[0, 2**31)``."""
        lens = [len(s) for s in seqs]
        total = sum(lens)
        if total > self._buf.shape[0]:
            self._buf = np.empty(max(total, 2 * self._buf.shape[0]), dtype=np.int32)
        buf = self._buf
        mv = memoryview(buf).cast("B")
        off = 0
        for i, (s, n) in enumerate(zip(seqs, lens)):
            try:
                if isinstance(s, np.ndarray):
                    if s.ndim != 1 or s.dtype.kind not in "iu" or (n and (s.min() < 0 or s.max() > _INT32_MAX)):
                        return i
                    buf[off:off + n] = s
                else:
                    struct.pack_into(f"{n}I", mv, off * 4, *s)
            except (struct.error, TypeError, ValueError):
                return i
            off += n
        if total and buf[:total].min() < 0:  # values in [2**31, 2**32) wrapped negative
            off = 0
            for i, n in enumerate(lens):
                if n and buf[off:off + n].min() < 0:
                    return i
                off += n
        out, off = [], 0
        for n in lens:
            out.append(buf[off:off + n])
            off += n
        return out


@dataclass
class UpdatePlan:
    """Everything :func:`apply_update` needs, already validated and converted."""

    finished: list[str]
    unscheduled: list[str]
    new_states: list[CachedRequestState]
    new_counts: list[int]
    readd: list[int]
    """Indices into ``scheduled_cached_reqs`` of requests that are resident but not in the batch."""
    readd_ids: list[str]
    rows_c: np.ndarray
    """``[num_cached]`` int64 batch rows of the cached requests (-1 for ``readd`` ones)."""
    counts_c: np.ndarray
    ncts_c: np.ndarray
    token_deltas: list[tuple[int, np.ndarray]] = field(default_factory=list)
    resumed: list[tuple[int, tuple[np.ndarray, ...]]] = field(default_factory=list)
    appends: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    """Per group: ``(cached indices, counts, flat ids)`` of appended blocks."""


def _check_sampling(req_id: str, sp: Any) -> None:
    if not isinstance(sp, SamplingParams):
        _err(req_id, "sampling_params", f"expected SamplingParams, got {type(sp).__name__}")
    if not sp.temperature >= 0:
        _err(req_id, "sampling_params", f"temperature must be >= 0 (0 is greedy), got {sp.temperature!r}")
    if not 0 < sp.top_p <= 1:
        _err(req_id, "sampling_params", f"top_p must be in (0, 1], got {sp.top_p!r}")


def _check_block_list(sc: "StepCompiler", req_id: str, fname: str, g: int, ids: np.ndarray,
                      null_ok: bool) -> None:
    """Range and length checks of one group's block ids (an initial or replacement list)."""
    n = ids.shape[0]
    if n > sc.max_num_blocks_per_req[g]:
        _err(req_id, fname, f"group {g}: {n} blocks but a request holds at most "
             f"{sc.max_num_blocks_per_req[g]} (cdiv(max_model_len={sc.max_model_len}, "
             f"block_size={sc.block_sizes[g]}))")
    if n:
        lo, hi = int(ids.min()), int(ids.max())
        low_ok = NULL_BLOCK_ID if null_ok else NULL_BLOCK_ID + 1
        if lo < low_ok or hi >= sc.num_blocks:
            bad = int(ids[(ids < low_ok) | (ids >= sc.num_blocks)][0])
            why = (f"block {NULL_BLOCK_ID} is the reserved null block, only legitimate in a sliding-"
                   "window group's skipped prefix" if bad == NULL_BLOCK_ID else "outside the pool")
            _err(req_id, fname, f"group {g}: block id {bad} is {why}; valid ids are "
                 f"[{low_ok}, {sc.num_blocks})")


def _check_capacity(sc: "StepCompiler", req_id: str, fname: str, g: int, num_blocks: int,
                    seq_len: int) -> None:
    if sc.group_kinds[g] != "mamba" and num_blocks * sc.block_sizes[g] < seq_len:
        _err(req_id, fname, f"group {g}: {num_blocks} blocks of {sc.block_sizes[g]} tokens cannot hold "
             f"seq_len {seq_len} (num_computed_tokens + num_scheduled_tokens); the block table is "
             "too short")


def _check_no_null_in_query(sc: "StepCompiler", req_id: str, fname: str, g: int, ids: np.ndarray,
                            start: int, end: int) -> None:
    """Scheduled positions ``[start, end)`` must not fall in null blocks (sliding window)."""
    B = sc.block_sizes[g]
    if sc.group_kinds[g] == "sliding_window" and end > start:
        span = ids[start // B:(end - 1) // B + 1]
        if (span == NULL_BLOCK_ID).any():
            _err(req_id, fname, f"group {g}: positions [{start}, {end}) fall in the null block; "
                 "only blocks no query can see may be null")


def _to_int32(req_id: str, fname: str, g: int, ids: Any) -> np.ndarray:
    try:
        a = np.asarray(ids, dtype=np.int64).reshape(len(ids))
    except (TypeError, ValueError, OverflowError):
        _err(req_id, fname, f"group {g}: block ids must be a list of ints, got {ids!r}")
    if a.shape[0] and (a.min() < 0 or a.max() > _INT32_MAX):
        _err(req_id, fname, f"group {g}: block ids must be in [0, 2**31), got {a.tolist()}")
    return a.astype(np.int32)


def _parse_groups(sc: "StepCompiler", req_id: str, fname: str, value: Any) -> list[Sequence[int]]:
    if not isinstance(value, (tuple, list)) or len(value) != sc.num_groups:
        _err(req_id, fname, f"expected one block-id list per cache group ({sc.num_groups}), got {value!r}")
    return list(value)


def plan_update(sc: "StepCompiler", so: SchedulerOutput) -> UpdatePlan:
    """Validate ``so`` against the compiler's state; change nothing.

    Raises:
        InvalidSchedulerOutput: the first problem found, with its request id and field.
    """
    batch, reqs = sc.input_batch, sc.requests
    idx = batch.req_id_to_index
    nst = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    C = cached.req_ids
    nC = len(C)
    if not isinstance(nst, dict):
        _err(None, "num_scheduled_tokens", f"expected a dict {{req_id: int}}, got {type(nst).__name__}")
    for name in ("resumed_from_preemption", "new_token_ids", "new_block_ids", "num_computed_tokens"):
        if len(getattr(cached, name)) != nC:
            _err(None, f"scheduled_cached_reqs.{name}", f"has {len(getattr(cached, name))} entries for "
                 f"{nC} req_ids: every list needs one entry per cached request")

    # --- finished and new ids -------------------------------------------------------------
    finished = list(dict.fromkeys(so.finished_req_ids))
    fin_set = set(finished)
    for rid in finished:
        if rid not in reqs:
            _err(rid, "finished_req_ids", "unknown request: the runner never held it or already dropped it")
    new_reqs = so.scheduled_new_reqs
    new_ids: set[str] = set()
    for nr in new_reqs:
        rid = nr.req_id
        if rid in reqs and rid not in fin_set:
            _err(rid, "scheduled_new_reqs", "request is already resident: send it in "
                 "scheduled_cached_reqs (or finish it in the same step to restart it)")
        if rid in new_ids:
            _err(rid, "scheduled_new_reqs", "request listed twice")
        new_ids.add(rid)

    # --- cached request rows (one lookup each) ---------------------------------------------
    try:
        rows_c = np.fromiter(map(idx.get, C, repeat(-1)), np.int64, nC)
    except TypeError:
        _err(None, "scheduled_cached_reqs.req_ids", "request ids must be hashable strings")
    in_batch = rows_c >= 0
    readd = [] if in_batch.all() else np.flatnonzero(~in_batch).tolist()
    readd_ids = set()
    for i in readd:
        rid = C[i]
        if rid not in reqs or rid in readd_ids:
            _err(rid, "scheduled_cached_reqs", "listed twice" if rid in readd_ids else
                 "unknown request: send it in scheduled_new_reqs first")
        if rid in fin_set:
            _err(rid, "finished_req_ids", "request is both finished and scheduled in this step")
        readd_ids.add(rid)
    present = rows_c[in_batch] if readd else rows_c
    sched_mask = np.zeros(sc.max_num_reqs, dtype=bool)
    if present.shape[0]:
        sched_mask[present] = True
        if int(np.count_nonzero(sched_mask)) != present.shape[0]:
            dup = np.bincount(present)
            _err(batch._req_ids[int(np.argmax(dup))], "scheduled_cached_reqs", "request listed twice")
    fin_in_batch = 0
    for rid in finished:
        r = idx.get(rid)
        if r is not None:
            if sched_mask[r]:
                _err(rid, "finished_req_ids", "request is both finished and scheduled in this step")
            fin_in_batch += 1

    # --- num_scheduled_tokens ----------------------------------------------------------------
    try:
        counts_c = np.fromiter(map(nst.__getitem__, C), np.int64, nC)
    except KeyError as e:
        _err(e.args[0], "num_scheduled_tokens", "scheduled cached request has no entry")
    except (TypeError, ValueError, OverflowError):
        bad = next(r for r in C if not isinstance(nst[r], (int, np.integer)))
        _err(bad, "num_scheduled_tokens", f"must be an int, got {nst[bad]!r}")
    new_counts = []
    for nr in new_reqs:
        c = nst.get(nr.req_id)
        if c is None:
            _err(nr.req_id, "num_scheduled_tokens", "new request has no entry")
        if not isinstance(c, (int, np.integer)) or isinstance(c, bool) or c < 1:
            _err(nr.req_id, "num_scheduled_tokens", f"must be an int >= 1, got {c!r}")
        new_counts.append(int(c))
    if len(nst) != nC + len(new_reqs):
        known = set(C) | new_ids
        extra = next(r for r in nst if r not in known)
        _err(extra, "num_scheduled_tokens", "request is in neither scheduled_new_reqs nor scheduled_cached_reqs")
    if nC and counts_c.min() < 1:
        i = int(np.argmax(counts_c < 1))
        _err(C[i], "num_scheduled_tokens", f"must be >= 1, got {int(counts_c[i])}")
    total = int(counts_c.sum()) + sum(new_counts)
    if total > sc.max_num_batched_tokens:
        _err(None, "num_scheduled_tokens", f"{total} tokens scheduled but max_num_batched_tokens is "
             f"{sc.max_num_batched_tokens}: the scheduler's token budget must not exceed the runner's")
    if so.total_num_scheduled_tokens != total:
        _err(None, "total_num_scheduled_tokens", f"is {so.total_num_scheduled_tokens} but the entries of "
             f"num_scheduled_tokens sum to {total}")
    if nC + len(new_reqs) > sc.max_num_reqs:
        _err(None, "num_scheduled_tokens", f"{nC + len(new_reqs)} requests scheduled but the batch holds "
             f"at most max_num_reqs={sc.max_num_reqs}")

    # --- num_computed_tokens, token deltas -------------------------------------------------------
    try:
        ncts_c = np.asarray(cached.num_computed_tokens, dtype=np.int64).reshape(nC)
    except (TypeError, ValueError, OverflowError):
        _err(None, "scheduled_cached_reqs.num_computed_tokens", "must be a list of ints")
    if nC and ncts_c.min() < 0:
        i = int(np.argmax(ncts_c < 0))
        _err(C[i], "num_computed_tokens", f"must be >= 0, got {int(ncts_c[i])}")
    held_c = batch.num_tokens[rows_c].astype(np.int64)
    for i in readd:
        held_c[i] = reqs[C[i]].num_tokens
    token_deltas: list[tuple[int, np.ndarray]] = []
    if any(cached.new_token_ids):
        tok_idx = [i for i, t in enumerate(cached.new_token_ids) if len(t)]
        packed = sc._delta_packer.pack([cached.new_token_ids[i] for i in tok_idx])
        if isinstance(packed, int):
            _err(C[tok_idx[packed]], "new_token_ids", "token ids must be ints in [0, 2**31)")
        for i, arr in zip(tok_idx, packed):
            held_c[i] += arr.shape[0]
            token_deltas.append((i, arr))
    if nC:
        if held_c.max() > sc.max_model_len:
            i = int(np.argmax(held_c))
            _err(C[i], "new_token_ids", f"request would hold {int(held_c[i])} tokens but max_model_len "
                 f"is {sc.max_model_len}")
        seq_c = ncts_c + counts_c
        if (seq_c > held_c).any():
            i = int(np.argmax(seq_c > held_c))
            if ncts_c[i] > held_c[i]:
                _err(C[i], "num_computed_tokens", f"{int(ncts_c[i])} exceeds the {int(held_c[i])} tokens "
                     "the request holds")
            _err(C[i], "num_scheduled_tokens", f"schedules positions [{int(ncts_c[i])}, {int(seq_c[i])}) "
                 f"but the request holds only {int(held_c[i])} tokens (send new tokens in new_token_ids)")
    else:
        seq_c = ncts_c

    # --- block deltas -------------------------------------------------------------------
    nb = cached.new_block_ids
    flags = cached.resumed_from_preemption
    resumed_idx = [i for i, f in enumerate(flags) if f] if any(flags) else []
    resumed_set = set(resumed_idx)
    resumed: list[tuple[int, tuple[np.ndarray, ...]]] = []
    for i in resumed_idx:
        rid = C[i]
        groups = [[]] * sc.num_groups if nb[i] is None else _parse_groups(sc, rid, "new_block_ids", nb[i])
        arrs = tuple(_to_int32(rid, "new_block_ids", g, ids) for g, ids in enumerate(groups))
        for g, a in enumerate(arrs):
            _check_block_list(sc, rid, "new_block_ids", g, a, sc.null_block_allowed[g])
            _check_capacity(sc, rid, "new_block_ids", g, a.shape[0], int(seq_c[i]))
            _check_no_null_in_query(sc, rid, "new_block_ids", g, a, int(ncts_c[i]), int(seq_c[i]))
        resumed.append((i, arrs))
    sel = list(compress(range(nC), nb))
    if resumed_set:
        sel = [i for i in sel if i not in resumed_set]
    appends = []
    sel_arr = np.asarray(sel, dtype=np.int64)
    entries = [nb[i] for i in sel]
    for e, i in zip(entries, sel):
        if not isinstance(e, (tuple, list)) or len(e) != sc.num_groups:
            _parse_groups(sc, C[i], "new_block_ids", e)
    for g, bt in enumerate(batch.block_table):
        before = bt.num_blocks_per_row[rows_c].astype(np.int64)
        for i in readd:
            before[i] = reqs[C[i]].block_ids_np()[g].shape[0]
        for i, arrs in resumed:
            before[i] = arrs[g].shape[0]
        if sel:
            per = [e[g] for e in entries]
            lens = np.fromiter(map(len, per), np.int64, len(per))
            try:
                flat = np.fromiter(chain.from_iterable(per), np.int64, int(lens.sum()))
            except (TypeError, ValueError, OverflowError):
                j = next(j for j, p in enumerate(per) if not all(isinstance(b, (int, np.integer)) for b in p))
                _err(C[sel[j]], "new_block_ids", f"group {g}: block ids must be ints")
            if flat.shape[0] and (flat.min() <= NULL_BLOCK_ID or flat.max() >= sc.num_blocks):
                t = int(np.argmax((flat <= NULL_BLOCK_ID) | (flat >= sc.num_blocks)))
                j = int(np.searchsorted(np.cumsum(lens), t, side="right"))
                _err(C[sel[j]], "new_block_ids", f"group {g}: appended block id {int(flat[t])} is not in "
                     f"[{NULL_BLOCK_ID + 1}, {sc.num_blocks}) (a newly appended block is never the null "
                     "block and must lie in the pool)")
            before[sel_arr] += lens
            appends.append((sel_arr, lens, flat))
        else:
            appends.append((sel_arr, np.zeros(0, np.int64), np.zeros(0, np.int64)))
        if nC:
            if before.max() > sc.max_num_blocks_per_req[g]:
                i = int(np.argmax(before))
                _err(C[i], "new_block_ids", f"group {g}: request would hold {int(before[i])} blocks but "
                     f"at most {sc.max_num_blocks_per_req[g]} fit (cdiv(max_model_len, block_size))")
            if sc.group_kinds[g] != "mamba" and (before * sc.block_sizes[g] < seq_c).any():
                i = int(np.argmax(before * sc.block_sizes[g] < seq_c))
                _check_capacity(sc, C[i], "new_block_ids", g, int(before[i]), int(seq_c[i]))

    # --- new requests ---------------------------------------------------------------------
    new_states = []
    if new_reqs:
        seqs = []
        for nr in new_reqs:
            if not len(nr.prompt_token_ids):
                _err(nr.req_id, "prompt_token_ids", "prompt is empty")
            seqs.append(nr.prompt_token_ids)
            if len(nr.output_token_ids):
                seqs.append(nr.output_token_ids)
        packed = sc._prompt_packer.pack(seqs)
        if isinstance(packed, int):
            owner = [nr for nr in new_reqs for _ in range(1 + bool(len(nr.output_token_ids)))][packed]
            _err(owner.req_id, "prompt_token_ids", "token ids must be ints in [0, 2**31)")
        k = 0
        for nr, cnt in zip(new_reqs, new_counts):
            rid = nr.req_id
            tokens = packed[k]
            k += 1
            if len(nr.output_token_ids):
                tokens = np.concatenate([tokens, packed[k]])
                k += 1
            held = tokens.shape[0]
            if held > sc.max_model_len:
                _err(rid, "prompt_token_ids", f"request holds {held} tokens but max_model_len is {sc.max_model_len}")
            ncts = nr.num_computed_tokens
            if not isinstance(ncts, (int, np.integer)) or ncts < 0:
                _err(rid, "num_computed_tokens", f"must be an int >= 0, got {ncts!r}")
            seq = int(ncts) + cnt
            if seq > held:
                _err(rid, "num_scheduled_tokens", f"schedules positions [{ncts}, {seq}) but the request "
                     f"holds only {held} tokens")
            groups = _parse_groups(sc, rid, "block_ids", nr.block_ids)
            arrs = []
            for g, ids in enumerate(groups):
                a = _to_int32(rid, "block_ids", g, ids)
                _check_block_list(sc, rid, "block_ids", g, a, sc.null_block_allowed[g])
                _check_capacity(sc, rid, "block_ids", g, a.shape[0], seq)
                _check_no_null_in_query(sc, rid, "block_ids", g, a, int(ncts), seq)
                arrs.append(a)
            _check_sampling(rid, nr.sampling_params)
            new_states.append(CachedRequestState(
                rid, nr.prompt_token_ids, arrs, int(ncts), nr.sampling_params, token_ids_np=tokens))

    # --- requests leaving the batch ---------------------------------------------------------
    unscheduled: list[str] = []
    if batch.num_reqs - fin_in_batch > present.shape[0]:
        unscheduled = [rid for rid, r in idx.items() if not sched_mask[r] and rid not in fin_set]
    return UpdatePlan(finished, unscheduled, new_states, new_counts, readd, [C[i] for i in readd], rows_c, counts_c, ncts_c,
                      token_deltas, resumed, appends)


def apply_update(sc: "StepCompiler", plan: UpdatePlan) -> None:
    """Apply a validated plan (see the module docstring for the order)."""
    batch, reqs = sc.input_batch, sc.requests
    for rid in plan.finished:
        batch.remove_request(rid)
        del reqs[rid]
    for rid in plan.unscheduled:
        batch.remove_request(rid)
    for st in plan.new_states:
        reqs[st.req_id] = st
    states = plan.new_states + [reqs[rid] for rid in plan.readd_ids]
    rows = batch.add_requests(states)
    rows_c = plan.rows_c
    n_new = len(plan.new_states)
    if plan.readd:
        rows_c[plan.readd] = rows[n_new:]
    if n_new:
        batch.num_scheduled_tokens[rows[:n_new]] = plan.new_counts
    batch.num_computed_tokens_cpu[rows_c] = plan.ncts_c
    batch.num_scheduled_tokens[rows_c] = plan.counts_c
    toks, n_tok = batch.token_ids_cpu, batch.num_tokens
    for i, arr in plan.token_deltas:
        r = rows_c[i]
        n = n_tok[r]
        toks[r, n:n + arr.shape[0]] = arr
        n_tok[r] = n + arr.shape[0]
    for i, arrs in plan.resumed:
        batch.block_table.add_row(arrs, int(rows_c[i]))
    for bt, (sel, lens, flat) in zip(batch.block_table, plan.appends):
        if sel.shape[0]:
            bt.append_rows(rows_c[sel], lens, flat)
    batch.condense()
    if sc.reorder_batch_threshold is not None:
        reorder_decodes_first(batch, sc.reorder_batch_threshold)


def reorder_decodes_first(batch, threshold: int) -> list[tuple[int, int]]:
    """Put rows with ``num_scheduled_tokens <= threshold`` (decodes) before the others.

    Pairs the first misplaced prefill with the last misplaced decode, swapping each pair
    (vLLM's ``reorder_batch_to_split_decodes_and_prefills``). Returns the swaps.
    """
    R = batch.num_reqs
    is_dec = batch.num_scheduled_tokens[:R] <= threshold
    d = int(np.count_nonzero(is_dec))
    front = np.flatnonzero(~is_dec[:d])
    if not front.shape[0]:
        return []
    back = (np.flatnonzero(is_dec[d:]) + d)[::-1]
    swaps = list(zip(front.tolist(), back.tolist()))
    for a, b in swaps:
        batch.swap_states(a, b)
    return swaps
