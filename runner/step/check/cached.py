"""Stage 1, cached requests: their rows, their counts, their computed tokens and token deltas.

The numpy path of the checks of ``scheduled_cached_reqs`` and ``num_scheduled_tokens``
(the compiled path is ``runner/step/check/fast.py``). Each function checks one field
family and returns it converted; none changes any state.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from itertools import repeat
from typing import NoReturn
from operator import itemgetter

import numpy as np

from attnplug.runner.step.check.types import err
from attnplug.runner.step.check.snapshot import CachedDeltas, Deltas
from attnplug.runner.step.check.types import is_int, is_int_list, request_id, show
from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.int_packer import IntPacker
from attnplug.runner.step.request_state import CachedRequestState


def int64s(values, n: int) -> np.ndarray:
    """``n`` Python ints → ``[n]`` ``int64`` with one ``struct`` call (2-3x faster than
    ``np.fromiter`` here). Raises ``struct.error`` / ``TypeError`` for a value that is not
    an int (floats included) or does not fit ``int64``."""
    out = np.empty(n, dtype=np.int64)
    if n:
        struct.pack_into(f"{n}q", out, 0, *values)
    return out


@dataclass
class CachedRows:
    """Where the cached requests are (from :func:`cached_rows`)."""

    rows_c: np.ndarray
    """``[num_cached]`` ``int64`` batch rows (``-1`` for ``readd`` ones)."""
    readd: list[int]
    """Indices (into ``scheduled_cached_reqs``) of resident requests not in the batch."""
    readd_ids: list[str]
    """Their ids."""
    present: np.ndarray
    """The rows of the cached requests that are in the batch."""
    sched_mask: np.ndarray
    """``[max_num_reqs]`` ``bool``: the row is scheduled this step."""
    fin_in_batch: int
    """Finished requests that hold a batch row."""


def _not_str(C: list) -> NoReturn:
    """Refuse the first id of ``C`` that is not a ``str`` (or ``str`` subclass:
    ``check.types.request_id``) or cannot be hashed (called after a lookup raised ``TypeError``)."""
    for r in C:
        request_id(r, "scheduled_cached_reqs.req_ids")
        try:
            hash(r)
        except TypeError:
            break
    err(None, "scheduled_cached_reqs.req_ids", f"request ids must be hashable str, got {type(r).__name__} {show(r)}")


def cached_rows(lay: StepLayout, batch: InputBatch, reqs: dict[str, CachedRequestState], C: list,
                finished: list[str], fin_set: set[str]) -> CachedRows:
    """The rows of ``C`` (the cached ids): one dict lookup each; unknown, repeated and
    finished-and-scheduled ids rejected."""
    idx = batch.req_id_to_index
    nC = len(C)
    try:  # itemgetter looks all ids up in one C call (it returns a bare value for one id)
        rows_c = int64s(itemgetter(*C)(idx), nC) if nC > 1 else np.fromiter(map(idx.__getitem__, C), np.int64, nC)
        readd = []
    except KeyError:  # some are resident but not in the batch (or unknown): look them up again
        try:
            rows_c = np.fromiter(map(idx.get, C, repeat(-1)), np.int64, nC)
        except TypeError:  # an unhashable id after the missing one
            _not_str(C)
        readd = np.flatnonzero(rows_c < 0).tolist()
    except TypeError:
        _not_str(C)
    readd_ids: list[str] = []
    for i in readd:
        rid = request_id(C[i], "scheduled_cached_reqs.req_ids")  # (a str subclass: its value)
        if rid not in reqs or rid in readd_ids:
            err(rid, "scheduled_cached_reqs", "request listed twice" if rid in readd_ids else
                "unknown request: send it in scheduled_new_reqs first")
        if rid in fin_set:
            err(rid, "finished_req_ids", "request is both finished and scheduled in this step")
        readd_ids.append(rid)
    present = rows_c[rows_c >= 0] if readd else rows_c
    sched_mask = np.zeros(lay.max_num_reqs, dtype=bool)
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
    return CachedRows(rows_c, readd, readd_ids, present, sched_mask, fin_in_batch)


def _counts_slow(nst: dict, C: list, new_reqs, new_ids: set, budget: int) -> tuple[np.ndarray, list[int], int]:
    """``num_scheduled_tokens`` in any order: look every request up, check every value
    (``budget``: ``max_num_batched_tokens``, no single count can exceed it)."""
    def count_of(rid, kind: str) -> int:
        c = nst.get(rid)
        if c is None:
            err(rid, "num_scheduled_tokens", f"{kind} request has no entry")
        if not isinstance(c, (int, np.integer)) or isinstance(c, bool) or c < 1:
            err(rid, "num_scheduled_tokens", f"must be an int >= 1, got {show(c)}")
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


def scheduled_counts(lay: StepLayout, so: Deltas, C: list, new_ids: set[str]
                     ) -> tuple[np.ndarray, list[int]]:
    """``num_scheduled_tokens`` checked against the requests and the budgets.

    Returns:
        ``(counts_c, new_counts)``: ``[num_cached]`` ``int64`` in ``C``'s order, and the
        new requests' counts in ``scheduled_new_reqs`` order.
    """
    nst = so.num_scheduled_tokens
    new_reqs = so.scheduled_new_reqs
    nC, nN = len(C), len(new_reqs)
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
            vals = int64s(nst.values(), nC + nN)
        except struct.error:  # an int beyond int64: the checked slow path words it
            vals = None
        if vals is not None and bool in set(map(type, nst.values())):  # struct takes True as 1
            vals = None
    if vals is not None:
        counts_c = vals[:nC]
        new_counts = vals[nC:].tolist()
    else:
        counts_c, new_counts, total = _counts_slow(nst, C, new_reqs, new_ids, lay.max_num_batched_tokens)
        vals = counts_c
    if vals.shape[0] and np.count_nonzero(vals < 1):
        bad = next(r for r in [*C, *(nr.req_id for nr in new_reqs)] if nst[r] < 1)
        err(bad, "num_scheduled_tokens", f"must be >= 1, got {nst[bad]!r}")
    if total > lay.max_num_batched_tokens:
        err(None, "num_scheduled_tokens", f"{total} tokens scheduled but max_num_batched_tokens is "
            f"{lay.max_num_batched_tokens}: the scheduler's token budget must not exceed the runner's")
    if not is_int(so.total_num_scheduled_tokens) or so.total_num_scheduled_tokens != total:
        err(None, "total_num_scheduled_tokens", f"is {show(so.total_num_scheduled_tokens)} but the entries of "
            f"num_scheduled_tokens sum to {total}")
    if nC + nN > lay.max_num_reqs:
        err(None, "num_scheduled_tokens", f"{nC + nN} requests scheduled but the batch holds at most "
            f"max_num_reqs={lay.max_num_reqs}")
    return counts_c, new_counts


def computed_and_token_deltas(lay: StepLayout, batch: InputBatch, reqs: dict[str, CachedRequestState],
                              cached: CachedDeltas, rows: CachedRows, counts_c: np.ndarray,
                              packer: IntPacker, drafts_c: np.ndarray | None = None
                              ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, np.ndarray]]]:
    """``num_computed_tokens`` and ``new_token_ids`` of the cached requests (``drafts_c``:
    ``[num_cached]`` drafts per request from ``check/spec.py``, held after its tokens).

    Returns:
        ``(ncts_c, seq_c, token_deltas)``: ``[num_cached]`` ``int64`` computed tokens and
        ``seq_lens``, and ``(index, [n] int32)`` for each request that carries tokens
        (views into ``packer``'s buffer).
    """
    C = cached.req_ids
    nC = len(C)
    ncts_list = cached.num_computed_tokens
    try:  # converts and type-checks in one pass: struct rejects floats, strings, None (not bools)
        ncts_c = int64s(ncts_list, nC)
        low = np.flatnonzero(ncts_c <= 1)  # a bool packs as 0 or 1: look at those entries only
        if low.shape[0] and any(type(ncts_list[i]) is bool for i in low.tolist()):
            raise TypeError("a bool")
    except (struct.error, TypeError, ValueError, OverflowError):
        bad = next((i for i, v in enumerate(ncts_list) if not isinstance(v, (int, np.integer))
                    or isinstance(v, bool)), None)
        if bad is not None:
            err(C[bad], "num_computed_tokens", f"must be an int, got {show(ncts_list[bad])}")
        bad = next(i for i, v in enumerate(ncts_list) if not -2**63 <= v < 2**63)
        toks = cached.new_token_ids[bad]
        held = reqs[C[bad]].num_tokens + (len(toks) if is_int_list(toks) else 0)
        err(C[bad], "num_computed_tokens", f"{show(ncts_list[bad])} is out of range: must be in "
            f"[0, {held}] (the tokens the request holds)")
    held_c = batch.num_tokens[rows.rows_c]
    for i in rows.readd:
        held_c[i] = reqs[C[i]].num_tokens
    if drafts_c is not None and drafts_c.shape[0] and drafts_c.any():
        held_c = held_c + drafts_c
    token_deltas: list[tuple[int, np.ndarray]] = []
    try:
        has_tokens = cached.new_token_ids.count([]) != nC
    except (TypeError, ValueError):  # numpy entries
        has_tokens = True
    if has_tokens:
        held_c = held_c.astype(np.int64)
        for i, t in enumerate(cached.new_token_ids):
            if not is_int_list(t):
                err(C[i], "new_token_ids", f"expected a list of token ids (empty for none), got {show(t)}")
        tok_idx = [i for i, t in enumerate(cached.new_token_ids) if len(t)]
        packed = packer.pack([cached.new_token_ids[i] for i in tok_idx])
        if isinstance(packed, int):
            err(C[tok_idx[packed]], "new_token_ids", "token ids must be ints in [0, 2**31)")
        for i, arr in zip(tok_idx, packed):
            held_c[i] += arr.shape[0]
            token_deltas.append((i, arr))
        if tok_idx and held_c.max() > lay.max_model_len:
            i = int(np.argmax(held_c))
            err(C[i], "new_token_ids", f"request would hold {int(held_c[i])} tokens but max_model_len is "
                f"{lay.max_model_len}")
    seq_c = ncts_c + counts_c
    if nC and (np.count_nonzero(ncts_c < 0) or np.count_nonzero(seq_c > held_c)):
        i = int(np.argmax((ncts_c < 0) | (seq_c > held_c)))
        if not 0 <= ncts_c[i] <= held_c[i]:
            err(C[i], "num_computed_tokens", f"{int(ncts_c[i])} is not in [0, {int(held_c[i])}] (the "
                "tokens the request holds)")
        err(C[i], "num_scheduled_tokens", f"schedules positions [{int(ncts_c[i])}, {int(seq_c[i])}) but the "
            f"request holds only {int(held_c[i])} tokens (send new tokens in new_token_ids)")
    return ncts_c, seq_c, token_deltas
