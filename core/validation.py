"""``validate``: the eight batch invariants of the step (below), as a debug check.

The runner calls it every step when ``ATTNPLUG_VALIDATE=1``; the tests always do. Each
failure raises :class:`MetadataInvariantError` naming the invariant, the row and values.

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
    qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
    seq_lens = cm.seq_lens_cpu.numpy().astype(np.int64)[:R]
    computed = cm.num_computed_tokens_cpu.numpy().astype(np.int64)[:R]

    # 1. inverse maps
    if batch is not None:
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
            _fail("1 req_ids/req_id_to_index inverse", None,
                  num_mapped=len(batch.req_id_to_index), num_reqs=R)
        # 2. every column of the row belongs to the row's request
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

    # 3. token count
    if num_scheduled_tokens is not None:
        total = int(np.sum(np.asarray(num_scheduled_tokens, dtype=np.int64)[:R]))
        if total != Q:
            _fail("3 token count", None, sum_num_scheduled_tokens=total, num_actual_tokens=Q)

    # 4. query_start_loc
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

    query_lens = d[:R]
    req_idx = np.repeat(np.arange(R), query_lens)
    offsets = np.arange(Q) - qsl[:R][req_idx]
    expected_pos = computed[req_idx] + offsets

    # 5. positions
    if cm.positions is not None:
        pos = cm.positions.cpu().numpy().astype(np.int64)[:Q]
        bad = pos != expected_pos
        if bad.any():
            t = _first_bad(bad)
            _fail("5 positions", int(req_idx[t]), token=t, position=int(pos[t]),
                  expected=int(expected_pos[t]))

    # 6. seq_lens vs capacity and last position
    last_pos_plus_1 = computed + query_lens
    bad = seq_lens != last_pos_plus_1
    if bad.any():
        r = _first_bad(bad)
        _fail("6 seq_lens", r, seq_len=int(seq_lens[r]), last_position_plus_1=int(last_pos_plus_1[r]))
    bt = cm.block_table_tensor.cpu().numpy()[:R] if block_size is not None else None
    if bt is not None:
        # capacity: blocks up to the last non-null entry (freed sliding-window blocks are null
        # but still occupy their logical index).
        nonnull = bt != NULL_BLOCK_ID
        has_any = nonnull.any(axis=1)
        last = np.where(has_any, bt.shape[1] - np.argmax(nonnull[:, ::-1], axis=1), 0)
        capacity = last * block_size
        bad = seq_lens > capacity
        if bad.any():
            r = _first_bad(bad)
            _fail("6 seq_lens", r, seq_len=int(seq_lens[r]), capacity=int(capacity[r]),
                  block_size=block_size, hint="the block table row is too short")

    # 7. slots
    slots = cm.slot_mapping.cpu().numpy().astype(np.int64)
    if (slots[Q:] != PAD_SLOT_ID).any():
        t = Q + _first_bad(slots[Q:] != PAD_SLOT_ID)
        _fail("7 slots", None, token=t, slot=int(slots[t]), hint="padded tokens must carry PAD_SLOT_ID")
    if bt is not None and Q:
        s = slots[:Q]
        blk = s // block_size
        logical = expected_pos // block_size
        ok_range = (s >= 0) & (logical < bt.shape[1])
        owner = np.where(ok_range, bt[req_idx, np.minimum(logical, bt.shape[1] - 1)], -1)
        bad = ~ok_range | (owner != blk) | (blk == NULL_BLOCK_ID) | (s % block_size != expected_pos % block_size)
        if bad.any():
            t = _first_bad(bad)
            _fail("7 slots", int(req_idx[t]), token=t, slot=int(s[t]), position=int(expected_pos[t]),
                  owned_block=int(owner[t]), hint="slot must lie in the request's block for that position")

    if bt is not None and Q:  # (a state group writes no paged slots: block_size is None)
        real = slots[:Q][slots[:Q] != PAD_SLOT_ID]
        srt = np.sort(real)
        dup = srt[1:] == srt[:-1]
        if dup.any():
            twice = int(srt[1:][dup][0])
            toks = np.flatnonzero(slots[:Q] == twice)
            _fail("7 slots", int(req_idx[toks[1]]), tokens=toks.tolist(), slot=twice,
                  rows=sorted({int(r) for r in req_idx[toks]}),
                  hint="two tokens of one step write one slot (a block id twice in a row's block list?)")

    if bt is not None and sliding_window is not None and R:
        mb = manager_block_size or block_size
        skipped = np.maximum(computed - sliding_window + 1, 0) // mb * (mb // block_size)
        cols = np.arange(bt.shape[1])
        bad = (cols[None, :] < skipped[:, None]) & (bt != NULL_BLOCK_ID)
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            _fail("7 slots", r, kernel_block_index=c, block=int(bt[r, c]), num_computed_tokens=int(computed[r]),
                  sliding_window=sliding_window, hint="blocks before the window were freed and must be null")
        # and every block a query of the step can see (from the first query's window on) is real
        first = np.maximum(computed - sliding_window + 1, 0) // block_size
        last = (seq_lens.astype(np.int64) - 1) // block_size
        bad = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None]) & (bt == NULL_BLOCK_ID)
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            _fail("7 slots", r, kernel_block_index=c, num_computed_tokens=int(computed[r]),
                  sliding_window=sliding_window, hint="a block this step's queries can see is the null block")

    if bt is not None and full_attention and R:
        last = (seq_lens.astype(np.int64) - 1) // block_size
        bad = (np.arange(bt.shape[1])[None, :] <= last[:, None]) & (bt == NULL_BLOCK_ID)
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            _fail("7 slots", r, kernel_block_index=c, num_computed_tokens=int(computed[r]),
                  hint="a full-attention block this step's queries can see is the null block")

    if state_group and R:
        slots0 = cm.block_table_tensor[:R, 0].cpu().numpy() if cm.block_table_tensor.shape[1] else None
        if slots0 is None or (slots0 == NULL_BLOCK_ID).any():
            r = 0 if slots0 is None else _first_bad(slots0 == NULL_BLOCK_ID)
            _fail("7 slots", r, hint="a Mamba state group's request must hold a real state slot (column 0)")

    # 8. discard
    if discard is not None and num_tokens is not None:
        disc = np.asarray(discard, dtype=bool)[:R]
        held = np.asarray(num_tokens, dtype=np.int64)[:R]
        expected = seq_lens < held
        bad = disc != expected
        if bad.any():
            r = _first_bad(bad)
            _fail("8 discard", r, discard=bool(disc[r]), seq_len=int(seq_lens[r]), num_tokens=int(held[r]))
