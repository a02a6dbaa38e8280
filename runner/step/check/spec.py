"""Stage 1, speculative decoding: ``scheduled_spec_decode_tokens`` checked against the rows.

A request may verify ``d >= 1`` drafts (vLLM's ``scheduled_spec_decode_tokens``) only when
it is a *decoding* cached request: exactly one real token is left to compute
(``num_tokens - num_computed_tokens == 1``) and it is scheduled ``1 + d`` tokens (that
token, then the drafts). Its drafts are written after its last token
(``InputBatch.num_spec_tokens``, ``runner/step/spec_apply.py``), so the row's
``seq_lens`` is ``num_tokens + d``, which must stay below ``max_model_len``: the row emits up to
``1 + d`` tokens (the accepted drafts, then the bonus token), and all of them must fit
(``runner/serve/spec_schedule.py`` proposes no more drafts than that).

Everything is read once and checked before stage 2 changes anything; the first problem
raises ``InvalidSchedulerOutput`` naming the request and the field. A regular step with
drafts is checked by the compiled cached scan with the rest of the cached requests
(``kernels.py``); this module is the vectorized check of every other step.
"""

from __future__ import annotations

import struct
from itertools import chain

import numpy as np

from attnplug.cache_groups.kinds import GroupKind
from attnplug.runner.step.check.cached import int64s
from attnplug.runner.step.check.snapshot import Deltas
from attnplug.runner.step.check.types import err, int64_list, is_flag, is_int, is_int_list, show
from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.plan import SpecTokens
from attnplug.runner.step.request_state import CachedRequestState

FIELD = "scheduled_spec_decode_tokens"


def check_spec_tokens(lay: StepLayout, batch: InputBatch, reqs: dict[str, CachedRequestState], d: Deltas,
                      rows_c: np.ndarray, counts_c: np.ndarray, new_ids: set[str]
                      ) -> tuple[np.ndarray, SpecTokens | None]:
    """Check the drafts of one output.

    Args:
        lay, batch, reqs: the layout and both views of the state (read only).
        d: the output as read once.
        rows_c: ``[num_cached]`` batch rows of the cached requests (``-1``: not in the batch).
        counts_c: ``[num_cached]`` their ``num_scheduled_tokens`` (already checked).
        new_ids: the ids of ``scheduled_new_reqs``.


    Returns:
        ``(drafts_c, spec)``: ``[num_cached]`` ``int64`` drafts per cached request (added to
        the tokens it holds for the ``seq_lens`` check), and the drafts as
        :class:`SpecTokens` (``None`` when no request has any).

    A regular output (lists of ints for decoding cached rows, scheduled ``1 + d``) is
    checked vectorized; anything else goes through the per-request loop that words the
    first problem (same result for valid input).

    Raises:
        InvalidSchedulerOutput: a key that is not a scheduled cached request (unknown, not
            scheduled, new, or resumed: still prefilling), drafts that are not token ids,
            a row with more than one real token left (prefilling), ``num_scheduled_tokens``
            other than ``1 + d``, or ``num_tokens + d >= max_model_len`` (no room for the
            ``1 + d`` tokens the row may emit).
    """
    if d.spec_packed is not None:  # the packed form (check/packed.py): arrays, no dict
        fast = _check_packed(lay, batch, d, rows_c, counts_c)
        if fast is not None:
            return fast
        d.spec_decode_tokens = _packed_as_dict(d)  # the loop below words the problem
    spec_in = d.spec_decode_tokens
    if not spec_in:
        return np.zeros(len(d.scheduled_cached_reqs.req_ids), dtype=np.int64), None
    fast = _check_fast(lay, batch, d, rows_c, counts_c)
    if fast is not None:
        return fast
    drafts_c, spec = _check_each(lay, batch, reqs, d, rows_c, counts_c, new_ids)
    if not spec:
        return drafts_c, None
    ids = [rid for rid, _ in spec]
    lens = np.asarray([a.shape[0] for _, a in spec], dtype=np.int64)
    return drafts_c, SpecTokens(ids, lens, np.concatenate([a for _, a in spec]).astype(np.int32))


def _check_fast(lay: StepLayout, batch: InputBatch, d: Deltas, rows_c: np.ndarray, counts_c: np.ndarray
                ) -> tuple[np.ndarray, SpecTokens] | None:
    """The vectorized check of a regular output, or ``None`` (then the loop decides)."""
    spec_in, cached = d.spec_decode_tokens, d.scheduled_cached_reqs
    C, nC = cached.req_ids, len(cached.req_ids)
    ids, vals = list(spec_in), list(spec_in.values())
    if set(map(type, ids)) != {str} or set(map(type, vals)) != {list} or True in cached.resumed_from_preemption:
        return None
    if cached.new_token_ids.count([]) != nC:
        return None
    where = dict(zip(C, range(nC)))
    try:
        idx = np.fromiter(map(where.__getitem__, ids), np.int64, len(ids))
        ncts = int64s(map(cached.num_computed_tokens.__getitem__, idx.tolist()), len(ids))
    except (KeyError, struct.error, TypeError):
        return None
    lens = np.fromiter(map(len, vals), np.int64, len(ids))
    rows = rows_c[idx]
    if not lens.all() or (rows < 0).any():
        return None
    held = batch.num_tokens[rows].astype(np.int64)
    if ((held - ncts != 1) | (counts_c[idx] != 1 + lens) | (held + lens >= lay.max_model_len)).any():
        return None
    try:  # struct takes ints only (floats, strings, None raise; a bool packs as 0 or 1)
        flat = int64s(chain.from_iterable(vals), int(lens.sum()))
    except (struct.error, TypeError):
        return None
    if flat.min() < 0 or flat.max() >= 2**31 or (
            np.count_nonzero(flat <= 1) and bool in set(map(type, chain.from_iterable(vals)))):
        return None
    drafts_c = np.zeros(nC, dtype=np.int64)
    drafts_c[idx] = lens
    return drafts_c, SpecTokens(ids, lens, flat.astype(np.int32))


def _check_packed(lay: StepLayout, batch: InputBatch, d: Deltas, rows_c: np.ndarray, counts_c: np.ndarray
                  ) -> tuple[np.ndarray, SpecTokens | None] | None:
    """:func:`_check_fast` of packed drafts (``d.spec_packed``, counts already checked
    against the ids), or ``None`` (then the loop decides)."""
    nd, flat = d.spec_packed
    cached = d.scheduled_cached_reqs
    C, nC = cached.req_ids, len(cached.req_ids)
    idx = np.flatnonzero(nd)
    if idx.shape[0] == 0:
        return np.zeros(nC, dtype=np.int64), None
    try:
        if True in cached.resumed_from_preemption or cached.new_token_ids.count([]) != nC:
            return None
        ncts = int64s(map(cached.num_computed_tokens.__getitem__, idx.tolist()), idx.shape[0])
    except (struct.error, TypeError, ValueError):
        return None
    lens, rows = nd[idx].astype(np.int64), rows_c[idx]
    if (rows < 0).any() or flat.min() < 0:
        return None
    held = batch.num_tokens[rows].astype(np.int64)
    if ((held - ncts != 1) | (counts_c[idx] != 1 + lens) | (held + lens >= lay.max_model_len)).any():
        return None
    drafts_c = np.zeros(nC, dtype=np.int64)
    drafts_c[idx] = lens
    ids = C if idx.shape[0] == nC else [C[i] for i in idx.tolist()]
    return drafts_c, SpecTokens(list(ids), lens, flat.copy())  # (the caller's array is not kept)


def _packed_as_dict(d: Deltas) -> dict[str, list[int]]:
    """``d.spec_packed`` as vLLM's ``{req_id: [drafts]}`` (requests with 0 drafts left out)."""
    nd, flat = d.spec_packed
    C, ids, counts, off, out = d.scheduled_cached_reqs.req_ids, flat.tolist(), nd.tolist(), 0, {}
    for i in np.flatnonzero(nd).tolist():
        out[C[i]] = ids[off:off + counts[i]]
        off += counts[i]
    return out


def _check_each(lay: StepLayout, batch: InputBatch, reqs: dict[str, CachedRequestState], d: Deltas,
                rows_c: np.ndarray, counts_c: np.ndarray, new_ids: set[str]
                ) -> tuple[np.ndarray, list[tuple[str, np.ndarray]]]:
    """Request by request; raises on the first problem (see :func:`check_spec_tokens`)."""
    spec_in = d.spec_decode_tokens
    cached = d.scheduled_cached_reqs
    C = cached.req_ids
    drafts_c = np.zeros(len(C), dtype=np.int64)
    spec: list[tuple[str, np.ndarray]] = []
    where = {rid: i for i, rid in enumerate(C)}
    for rid, toks in spec_in.items():
        if not isinstance(rid, str):  # (a str subclass such as numpy.str_ too, as in req_ids)
            err(None, FIELD, f"request ids must be str, got {show(rid)}")
        if not is_int_list(toks):
            err(rid, FIELD, f"expected a list of draft token ids, got {show(toks)}")
        arr = int64_list(list(toks)) if not isinstance(toks, np.ndarray) else toks.astype(np.int64)
        if arr is None or (arr.shape[0] and (arr.min() < 0 or arr.max() >= 2**31)):
            err(rid, FIELD, f"draft token ids must be ints in [0, 2**31), got {show(toks)}")
        if arr.shape[0] == 0:
            continue
        if rid in new_ids:
            err(rid, FIELD, "drafts for a new request: it is still prefilling (drafts only for "
                "decoding rows, one real token left to compute)")
        i = where.get(rid)
        if i is None:
            known = rid in reqs
            err(rid, FIELD, "request is resident but not scheduled this step" if known else
                "unknown request: not in scheduled_cached_reqs")
        flag = cached.resumed_from_preemption[i]
        if is_flag(flag) and flag:
            err(rid, FIELD, "drafts for a request resumed from preemption: it is still prefilling")
        ncts = cached.num_computed_tokens[i]
        if not is_int(ncts):
            continue  # computed_and_token_deltas words this one
        r = int(rows_c[i])
        held = int(batch.num_tokens[r]) if r >= 0 else reqs[rid].num_tokens
        new_toks = cached.new_token_ids[i]
        held += len(new_toks) if is_int_list(new_toks) else 0
        left, nd, n = held - int(ncts), int(arr.shape[0]), int(counts_c[i])
        if left > 1:
            err(rid, FIELD, f"row still prefilling: {left} real tokens left to compute "
                f"(num_computed_tokens={int(ncts)} of {held}); drafts only for decoding rows")
        if left < 1:
            err(rid, FIELD, f"num_computed_tokens={int(ncts)} leaves no real token of {held} to compute: "
                "a verifying row computes its last token, then the drafts")
        if n != 1 + nd:
            err(rid, FIELD, f"{nd} drafts need num_scheduled_tokens == 1 + {nd}, got {n}"
                + (" (more drafts than the step's budget for the request)" if nd > n - 1 else ""))
        if held + nd >= lay.max_model_len:
            err(rid, FIELD, f"{nd} drafts after {held} tokens leave no room for the {nd + 1} tokens the row may "
                f"emit within max_model_len={lay.max_model_len} (at most {lay.max_model_len - held - 1} drafts)")
        drafts_c[i] = nd
        spec.append((rid, arr.astype(np.int32)))
    return drafts_c, spec


def check_state_slots(lay: StepLayout, batch: InputBatch, reqs: dict[str, CachedRequestState], d: Deltas,
                      spec: SpecTokens | None) -> None:
    """Each verifying request holds ``1 + d`` slots in every state (``"mamba"``) group: its
    state in slot 0 and one scratch slot per draft position (docs/speculative-decoding.md,
    "State groups"). Counts the blocks the row holds plus this step's ``new_block_ids``.

    Raises:
        InvalidSchedulerOutput: naming the first request with too few, field
            ``scheduled_spec_decode_tokens``.
    """
    if spec is None or GroupKind.MAMBA not in lay.group_kinds:  # (0.6 → 0.1 µs a step without state groups)
        return
    groups = [g for g, k in enumerate(lay.group_kinds) if k is GroupKind.MAMBA]
    cached = d.scheduled_cached_reqs
    where = {rid: i for i, rid in enumerate(cached.req_ids)}
    index = batch.req_id_to_index
    for rid, nd in zip(spec.req_ids, spec.lens.tolist()):
        row = index.get(rid)
        new = cached.new_block_ids[where[rid]]
        for g in groups:
            held = (int(batch.block_table.num_blocks_per_row[g, row]) if row is not None
                    else len(reqs[rid].block_ids[g]))
            held += len(new[g]) if new is not None and new[g] is not None else 0
            if held < 1 + nd:
                err(rid, FIELD, f"{nd} drafts need 1 + {nd} state slots in state group {g} (the request's state "
                    f"and one per draft position), the request holds {held}: the state pool was sized for fewer "
                    "drafts (KVCacheConfig.state_slots_per_request)")
