"""``validate``: the eight batch invariants of the step (below), as a debug check.

The runner calls it every step when ``ATTNPLUG_VALIDATE=1``; the tests always do. Each
failure raises :class:`MetadataInvariantError` naming the invariant, the row and values.
Each check is a named function (``check_inverse_maps`` … ``check_discard``); ``validate``
runs them in the order below.

1. ``req_ids[row]`` and ``req_id_to_index[req_id]`` are inverse maps.
2. Every column of a row (tokens, counts, block table; the sampling columns and the
   generator when the view carries them) belongs to one request.
3. ``sum(num_scheduled_tokens) == num_actual_tokens``.
4. ``query_start_loc[0] == 0``, non-decreasing, ``query_start_loc[num_reqs] == num_actual_tokens``.
5. ``positions == num_computed_tokens[req] + offset within request``.
6. ``seq_lens[i]`` <= capacity of its block-table row, and == last position + 1.
7. Every non-padding slot lies in a (non-null) block owned by its request; padded tokens
   carry ``PAD_SLOT_ID``; the real slots of one step are distinct (two tokens never write
   one slot: a block id repeated in a row's list would do it). For a sliding-window group (``sliding_window`` given), the
   blocks wholly before ``max(0, num_computed_tokens - W + 1)`` are ``NULL_BLOCK_ID``:
   they were freed and no kernel may read them; every block from there to the last
   position is real (a query of the step sees it). A Mamba state group's row holds a
   real state slot.
8. Logits of a partial prefill are discarded: ``discard[i] == (seq_lens[i] < num_tokens[i])``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.errors import MetadataInvariantError
from attnplug.core.metadata import CommonAttentionMetadata


@dataclass
class RowState:
    """The object view of one request (what its batch row must agree with)."""

    req_id: str
    token_ids: Sequence[int]
    """All tokens the request holds: prompt then outputs."""
    num_computed_tokens: int
    block_ids: tuple[Sequence[int], ...]
    """Manager block ids per cache group."""
    sampling: tuple[float, int, float] | None = None
    """``(temperature, top_k, top_p)`` of the request; ``None``: not checked."""
    generator: object | None = None
    """The request's ``torch.Generator`` (``None`` when unseeded); checked, by identity,
    when the batch view carries ``generators``."""


@dataclass
class BatchView:
    """The columnar view of the batch, as numpy arrays (rows ``0 .. num_reqs-1``)."""

    req_ids: Sequence[str | None]
    req_id_to_index: Mapping[str, int]
    token_ids: np.ndarray
    """``[max_num_reqs, max_model_len]`` token table."""
    num_tokens: np.ndarray
    """``[>= num_reqs]`` tokens held per row."""
    num_computed_tokens: np.ndarray
    block_ids: Sequence[np.ndarray]
    """Per group: ``[>= num_reqs, max_num_blocks]`` manager block ids."""
    num_blocks: Sequence[np.ndarray]
    """Per group: ``[>= num_reqs]`` valid blocks per row."""
    states: Mapping[str, RowState] = field(default_factory=dict)
    sampling: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """``(temperature, top_k, top_p)`` columns, ``[>= num_reqs]`` each; ``None``: not checked."""
    generators: Mapping[int, object] | None = None
    """``{row: generator}`` of the seeded rows; ``None``: not checked."""


def _fail(inv: str, row: int | None, hint: str = "", **values) -> None:
    raise MetadataInvariantError(inv, row, values, hint)


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_sampling(batch: BatchView, row: int, st: RowState) -> None:
    """Invariant 2 for the sampling columns and the generator of one row."""
    if batch.sampling is not None and st.sampling is not None:
        for name, col, want in zip(("temperature", "top_k", "top_p"), batch.sampling, st.sampling):
            if col[row] != np.asarray(want, dtype=col.dtype):
                _fail("2 row columns", row, req_id=st.req_id, column=name, batch=col[row].item(), request=want)
    if batch.generators is not None and batch.generators.get(row) is not st.generator:
        _fail("2 row columns", row, req_id=st.req_id, column="generator",
              hint="the row's generator is not its request's (a row move left it behind or swapped it)")


@dataclass
class _Step:
    """The host arrays every check reads (``R`` rows, ``Q`` real tokens)."""

    R: int
    Q: int
    qsl: np.ndarray
    seq_lens: np.ndarray
    computed: np.ndarray
    req_idx: np.ndarray | None = None
    """``[Q]`` the row of each token (after invariant 4)."""
    expected_pos: np.ndarray | None = None
    """``[Q]`` each token's position (after invariant 4)."""
    query_lens: np.ndarray | None = None


def check_inverse_maps(batch: BatchView, R: int) -> None:
    """Invariant 1: ``req_ids[row]`` and ``req_id_to_index[req_id]`` are inverse maps."""
    for row in range(R):
        rid = batch.req_ids[row] if row < len(batch.req_ids) else None
        if rid is None or batch.req_id_to_index.get(rid) != row:
            _fail("1 req_ids/req_id_to_index inverse", row, req_id=rid,
                  req_id_to_index=None if rid is None else batch.req_id_to_index.get(rid))
    for rid, row in batch.req_id_to_index.items():
        if row >= len(batch.req_ids) or batch.req_ids[row] != rid:
            _fail("1 req_ids/req_id_to_index inverse", row, req_id=rid,
                  req_ids_at_row=batch.req_ids[row] if row < len(batch.req_ids) else None)
    if len(batch.req_id_to_index) != R:
        _fail("1 req_ids/req_id_to_index inverse", None, num_mapped=len(batch.req_id_to_index), num_reqs=R)


def check_row_columns(batch: BatchView, R: int) -> None:
    """Invariant 2: every column of a row belongs to the row's request."""
    for row in range(R):
        st = batch.states.get(batch.req_ids[row]) if batch.states else None
        if st is None:
            continue
        n = len(st.token_ids)
        if int(batch.num_tokens[row]) != n:
            _fail("2 row columns", row, req_id=st.req_id, column="num_tokens",
                  batch=int(batch.num_tokens[row]), request=n)
        if not np.array_equal(batch.token_ids[row, :n], np.asarray(st.token_ids, dtype=batch.token_ids.dtype)):
            _fail("2 row columns", row, req_id=st.req_id, column="token_ids")
        if int(batch.num_computed_tokens[row]) != st.num_computed_tokens:
            _fail("2 row columns", row, req_id=st.req_id, column="num_computed_tokens",
                  batch=int(batch.num_computed_tokens[row]), request=st.num_computed_tokens)
        for g, ids in enumerate(st.block_ids):
            nb = int(batch.num_blocks[g][row])
            if nb != len(ids) or not np.array_equal(batch.block_ids[g][row, :nb], np.asarray(ids)):
                _fail("2 row columns", row, req_id=st.req_id, column=f"block_table[group {g}]",
                      batch=batch.block_ids[g][row, :nb].tolist(), request=list(ids))
        _check_sampling(batch, row, st)


def check_token_count(step: _Step, num_scheduled_tokens) -> None:
    """Invariant 3: ``sum(num_scheduled_tokens) == num_actual_tokens``."""
    total = int(np.sum(np.asarray(num_scheduled_tokens, dtype=np.int64)[:step.R]))
    if total != step.Q:
        _fail("3 token count", None, sum_num_scheduled_tokens=total, num_actual_tokens=step.Q)


def check_query_start_loc(step: _Step, num_scheduled_tokens) -> None:
    """Invariant 4: ``query_start_loc`` starts at 0, never decreases, ends at ``Q`` (and
    matches ``num_scheduled_tokens`` when given); fills ``step``'s per-token arrays."""
    R, Q, qsl = step.R, step.Q, step.qsl
    if qsl.shape[0] < R + 1:
        _fail("4 query_start_loc", None, length=int(qsl.shape[0]), num_reqs=R)
    if qsl[0] != 0:
        _fail("4 query_start_loc", 0, query_start_loc_0=int(qsl[0]))
    d = np.diff(qsl)
    if (d < 0).any():
        r = _first_bad(d < 0)
        _fail("4 query_start_loc", r, query_start_loc=qsl[r:r + 2].tolist(), hint="must be non-decreasing")
    if qsl[R] != Q:
        _fail("4 query_start_loc", R, query_start_loc_last=int(qsl[R]), num_actual_tokens=Q)
    if num_scheduled_tokens is not None:
        ns = np.asarray(num_scheduled_tokens, dtype=np.int64)[:R]
        bad = d[:R] != ns
        if bad.any():
            r = _first_bad(bad)
            _fail("4 query_start_loc", r, query_len=int(d[r]), num_scheduled_tokens=int(ns[r]))
    step.query_lens = d[:R]
    step.req_idx = np.repeat(np.arange(R), step.query_lens)
    step.expected_pos = step.computed[step.req_idx] + np.arange(Q) - qsl[:R][step.req_idx]


def check_positions(step: _Step, cm: CommonAttentionMetadata) -> None:
    """Invariant 5: ``positions == num_computed_tokens[req] + offset within request``."""
    if cm.positions is None:
        return
    pos = cm.positions.cpu().numpy().astype(np.int64)[:step.Q]
    bad = pos != step.expected_pos
    if bad.any():
        t = _first_bad(bad)
        _fail("5 positions", int(step.req_idx[t]), token=t, position=int(pos[t]), expected=int(step.expected_pos[t]))


def check_seq_lens(step: _Step, bt: np.ndarray | None, block_size: int | None) -> None:
    """Invariant 6: ``seq_lens`` is the last position + 1 and fits the block-table row."""
    seq_lens = step.seq_lens
    last_pos_plus_1 = step.computed + step.query_lens
    bad = seq_lens != last_pos_plus_1
    if bad.any():
        r = _first_bad(bad)
        _fail("6 seq_lens", r, seq_len=int(seq_lens[r]), last_position_plus_1=int(last_pos_plus_1[r]))
    if bt is None:
        return
    # capacity: blocks up to the last non-null entry (freed sliding-window blocks are null
    # but still occupy their logical index).
    nonnull = bt != NULL_BLOCK_ID
    last = np.where(nonnull.any(axis=1), bt.shape[1] - np.argmax(nonnull[:, ::-1], axis=1), 0)
    capacity = last * block_size
    bad = seq_lens > capacity
    if bad.any():
        r = _first_bad(bad)
        _fail("6 seq_lens", r, seq_len=int(seq_lens[r]), capacity=int(capacity[r]),
              block_size=block_size, hint="the block table row is too short")


def check_slots_in_own_blocks(step: _Step, slots: np.ndarray, bt: np.ndarray | None, block_size: int | None) -> None:
    """Invariant 7: padded tokens carry ``PAD_SLOT_ID``; every real slot lies in the
    (non-null) block its request holds for that position."""
    Q = step.Q
    if (slots[Q:] != PAD_SLOT_ID).any():
        t = Q + _first_bad(slots[Q:] != PAD_SLOT_ID)
        _fail("7 slots", None, token=t, slot=int(slots[t]), hint="padded tokens must carry PAD_SLOT_ID")
    if bt is None or not Q:
        return
    s, req_idx, expected_pos = slots[:Q], step.req_idx, step.expected_pos
    blk = s // block_size
    logical = expected_pos // block_size
    ok_range = (s >= 0) & (logical < bt.shape[1])
    owner = np.where(ok_range, bt[req_idx, np.minimum(logical, bt.shape[1] - 1)], -1)
    bad = ~ok_range | (owner != blk) | (blk == NULL_BLOCK_ID) | (s % block_size != expected_pos % block_size)
    if bad.any():
        t = _first_bad(bad)
        _fail("7 slots", int(req_idx[t]), token=t, slot=int(s[t]), position=int(expected_pos[t]),
              owned_block=int(owner[t]), hint="slot must lie in the request's block for that position")


def check_slots_distinct(step: _Step, slots: np.ndarray) -> None:
    """Invariant 7: the real slots of one step are distinct (two tokens never write one)."""
    Q = step.Q
    srt = np.sort(slots[:Q][slots[:Q] != PAD_SLOT_ID])
    dup = srt[1:] == srt[:-1]
    if dup.any():
        twice = int(srt[1:][dup][0])
        toks = np.flatnonzero(slots[:Q] == twice)
        _fail("7 slots", int(step.req_idx[toks[1]]), tokens=toks.tolist(), slot=twice,
              rows=sorted({int(r) for r in step.req_idx[toks]}),
              hint="two tokens of one step write one slot (a block id twice in a row's block list?)")


def check_window_blocks(step: _Step, bt: np.ndarray, block_size: int, sliding_window: int,
                        manager_block_size: int | None) -> None:
    """Invariant 7, sliding window: blocks wholly before the first query's window are null;
    every block from there to the last position is real."""
    computed = step.computed
    mb = manager_block_size or block_size
    skipped = np.maximum(computed - sliding_window + 1, 0) // mb * (mb // block_size)
    cols = np.arange(bt.shape[1])
    bad = (cols[None, :] < skipped[:, None]) & (bt != NULL_BLOCK_ID)
    if bad.any():
        r, c = (int(x) for x in np.argwhere(bad)[0])
        _fail("7 slots", r, kernel_block_index=c, block=int(bt[r, c]), num_computed_tokens=int(computed[r]),
              sliding_window=sliding_window, hint="blocks before the window were freed and must be null")
    first = np.maximum(computed - sliding_window + 1, 0) // block_size
    last = (step.seq_lens - 1) // block_size
    bad = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None]) & (bt == NULL_BLOCK_ID)
    if bad.any():
        r, c = (int(x) for x in np.argwhere(bad)[0])
        _fail("7 slots", r, kernel_block_index=c, num_computed_tokens=int(computed[r]),
              sliding_window=sliding_window, hint="a block this step's queries can see is the null block")


def check_full_attention_blocks(step: _Step, bt: np.ndarray, block_size: int) -> None:
    """Invariant 7, full attention: every block a query of the step can see is real."""
    last = (step.seq_lens - 1) // block_size
    bad = (np.arange(bt.shape[1])[None, :] <= last[:, None]) & (bt == NULL_BLOCK_ID)
    if bad.any():
        r, c = (int(x) for x in np.argwhere(bad)[0])
        _fail("7 slots", r, kernel_block_index=c, num_computed_tokens=int(step.computed[r]),
              hint="a full-attention block this step's queries can see is the null block")


def check_state_slots(step: _Step, cm: CommonAttentionMetadata) -> None:
    """Invariant 7, Mamba state group: every row holds a real state slot in column 0."""
    R = step.R
    slots0 = cm.block_table_tensor[:R, 0].cpu().numpy() if cm.block_table_tensor.shape[1] else None
    if slots0 is None or (slots0 == NULL_BLOCK_ID).any():
        r = 0 if slots0 is None else _first_bad(slots0 == NULL_BLOCK_ID)
        _fail("7 slots", r, hint="a Mamba state group's request must hold a real state slot (column 0)")


def check_discard(step: _Step, discard, num_tokens) -> None:
    """Invariant 8: ``discard[i] == (seq_lens[i] < num_tokens[i])``."""
    R = step.R
    disc = np.asarray(discard, dtype=bool)[:R]
    held = np.asarray(num_tokens, dtype=np.int64)[:R]
    bad = disc != (step.seq_lens < held)
    if bad.any():
        r = _first_bad(bad)
        _fail("8 discard", r, discard=bool(disc[r]), seq_len=int(step.seq_lens[r]), num_tokens=int(held[r]))


def validate(
    cm: CommonAttentionMetadata,
    *,
    block_size: int | None = None,
    num_scheduled_tokens: Sequence[int] | np.ndarray | None = None,
    num_tokens: Sequence[int] | np.ndarray | None = None,
    discard: Sequence[bool] | np.ndarray | None = None,
    batch: BatchView | None = None,
    sliding_window: int | None = None,
    manager_block_size: int | None = None,
    state_group: bool = False,
    full_attention: bool = False,
) -> None:
    """Check the eight invariants on one step's metadata (for one cache group).

    Args:
        cm: the step's metadata (``block_table_tensor`` / ``slot_mapping`` of the group whose
            kernel block size is ``block_size``).
        block_size: the kernel block size of ``cm.block_table_tensor``; invariants 6 and 7
            need it and are skipped without it.
        num_scheduled_tokens: ``[num_reqs]`` the scheduler's counts in row order (invariant 3).
        num_tokens: ``[num_reqs]`` tokens each request holds (invariant 8, with ``discard``).
        discard: ``[num_reqs]`` bools, the runner's discard mask (invariant 8).
        batch: the input batch's columnar view (invariants 1 and 2).
        sliding_window: ``W`` of a sliding-window group: also check (invariant 7) that the
            manager blocks no query can see are null in the block table (needs
            ``block_size``).
        manager_block_size: the group's manager block size (a multiple of ``block_size``);
            default ``block_size``.
        state_group: the group is a Mamba state group (``block_size`` is then ``None``):
            check (invariant 7) that every row holds a real state slot in column 0.
        full_attention: the group is full attention: also check (invariant 7) that every
            block a query can see (columns ``0 .. (seq_len - 1) // block_size``; with prefix
            caching, shared blocks before ``num_computed_tokens`` too) is real.

    Raises:
        MetadataInvariantError: the first invariant that fails, with its row and values.

    Synchronises with the host (reads device tensors); debug use only.
    """
    R, Q = cm.num_reqs, cm.num_actual_tokens
    step = _Step(R, Q, cm.query_start_loc_cpu.numpy().astype(np.int64),
                 cm.seq_lens_cpu.numpy().astype(np.int64)[:R], cm.num_computed_tokens_cpu.numpy().astype(np.int64)[:R])
    if batch is not None:
        check_inverse_maps(batch, R)
        check_row_columns(batch, R)
    if num_scheduled_tokens is not None:
        check_token_count(step, num_scheduled_tokens)
    check_query_start_loc(step, num_scheduled_tokens)
    check_positions(step, cm)
    bt = cm.block_table_tensor.cpu().numpy()[:R] if block_size is not None else None
    check_seq_lens(step, bt, block_size)
    slots = cm.slot_mapping.cpu().numpy().astype(np.int64)
    check_slots_in_own_blocks(step, slots, bt, block_size)
    if bt is not None and Q:  # (a state group writes no paged slots: block_size is None)
        check_slots_distinct(step, slots)
    if bt is not None and sliding_window is not None and R:
        check_window_blocks(step, bt, block_size, sliding_window, manager_block_size)
    if bt is not None and full_attention and R:
        check_full_attention_blocks(step, bt, block_size)
    if state_group and R:
        check_state_slots(step, cm)
    if discard is not None and num_tokens is not None:
        check_discard(step, discard, num_tokens)
