"""The ``torch_native`` builder's segments, lowered from host numpy in a constant number of
calls (``AttentionSegment`` is defined in ``builder.py``; see its module docstring).

* **decode segment** (every one-token row): the per-row index arrays packed into one host
  array, one device upload, one ``unbind``; full-attention decodes in consecutive rows
  read a view of the block table, a sliding window gathers each row's live window blocks.
* **prefill segments** (one per multi-token row): every row's arrays (token rows,
  positions, ``seq_len``, key offset) computed in one vectorised pass over the prefill
  rows, packed into one host array, one upload, one ``split`` per field; each segment's
  key blocks are a view of its block-table row (columns ``first_block .. first_block +
  num_key_blocks - 1``, all of them the request's blocks), so no per-row device op runs.

Every build allocates its packed arrays afresh, so a step's metadata stays valid after the
builder's next build (the golden reference favours plain semantics over reuse).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from attnplug.cache_groups.buffers import upload
from attnplug.cache_groups.ragged import cumsum_and_arange
from attnplug.cache_groups.sliding_window import num_skipped_blocks
from attnplug.core.constants import NULL_BLOCK_ID


def key_block_ids(block_table: torch.Tensor, req_indices: torch.Tensor, columns: torch.Tensor,
                  live: torch.Tensor) -> torch.Tensor:
    """``[n, num_key_blocks]`` int64 block ids at ``columns`` of the requests' block-table
    rows; ``NULL_BLOCK_ID`` where not ``live`` (whatever the block table holds there)."""
    block_ids = block_table.index_select(0, req_indices).gather(1, columns).long()
    return block_ids.masked_fill_(~live, NULL_BLOCK_ID)


def decode_segment(make: Callable, block_table: torch.Tensor, rows: np.ndarray, qsl: np.ndarray,
                   seq: np.ndarray, block_size: int, window: int | None, device: torch.device):
    """The one segment of every one-token row (``rows``, ascending); ``make`` is
    ``AttentionSegment``. ``qsl`` / ``seq`` are the step's host ``query_start_loc`` /
    ``seq_lens`` (int)."""
    B, n = block_size, rows.shape[0]
    lo = int(rows[0])
    consecutive = int(rows[-1]) - lo == n - 1
    seg_seq = seq[lo:lo + n] if consecutive else seq[rows]
    num_blocks = (seg_seq + B - 1) // B
    first = None if window is None else num_skipped_blocks(seg_seq - 1, window, B)
    num_key_blocks = int(num_blocks.max() if first is None else (num_blocks - first).max())
    packed = np.empty((5, n), dtype=np.int64)  # rows, token rows, seq_lens, positions, key offsets
    packed[0] = rows
    packed[1] = qsl[lo:lo + n] if consecutive else qsl[rows]
    packed[2] = seg_seq
    np.subtract(seg_seq, 1, out=packed[3])
    if first is None:
        packed[4] = 0
    else:
        np.multiply(first, B, out=packed[4])
    rows_t, tokens, seq_t, positions, offsets = upload(packed, device).unbind(0)
    columns = live = row_start = None
    if first is None and consecutive:
        row_start = lo
        block_ids = block_table[lo:lo + n, :num_key_blocks]
        min_off = max_off = 0
    else:
        base = np.zeros(n, dtype=np.int64) if first is None else first
        cols = base[:, None] + np.arange(num_key_blocks, dtype=np.int64)[None, :]
        live_np = cols < num_blocks[:, None]
        columns = upload(np.where(live_np, cols, 0), device)
        live = upload(live_np, device)
        block_ids = key_block_ids(block_table, rows_t, columns, live)
        min_off, max_off = int(packed[4].min()), int(packed[4].max())
    return make(
        req_indices=rows_t, query_len=1, max_seq_len=int(seg_seq.max()), min_seq_len=int(seg_seq.min()),
        query_token_indices=tokens.unsqueeze(1), query_positions=positions.unsqueeze(1), seq_lens=seq_t,
        key_block_ids=block_ids, key_offsets=offsets, min_key_offset=min_off, max_key_offset=max_off,
        key_block_columns=columns, key_block_live=live, row_start=row_start)


class DecodeConstants:
    """Read-only device tensors of an all-decode step of ``n`` rows, cached per ``n``:
    ``arange(n)`` (rows, and token rows: request ``i``'s token is row ``i``), as ``[n]`` and
    ``[n, 1]``, and ``zeros(n)`` (key offsets). Never written, so every build may share them."""

    def __init__(self, max_num_reqs: int, device: torch.device):
        self._arange = torch.arange(max(1, max_num_reqs), dtype=torch.int64, device=device)
        self._zeros = torch.zeros(max(1, max_num_reqs), dtype=torch.int64, device=device)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows [n], token rows [n, 1], key offsets [n])``."""
        views = self._views.get(n)
        if views is None:
            if n > self._arange.shape[0]:  # more rows than configured: grow (new tensors; old views stay valid)
                self._arange = torch.arange(n, dtype=torch.int64, device=self._arange.device)
                self._zeros = torch.zeros(n, dtype=torch.int64, device=self._zeros.device)
            rows = self._arange[:n]
            if len(self._views) > 64:
                self._views.clear()
            views = self._views[n] = (rows, rows.view(n, 1), self._zeros[:n])
        return views


def all_decode_segment(make: Callable, block_table: torch.Tensor, seq: np.ndarray, block_size: int,
                       constants: DecodeConstants, device: torch.device):
    """The decode segment of a step whose ``n`` rows all decode (one token each, rows
    ``0 .. n - 1``, token ``i`` of row ``i``), full attention: the row and token indices and
    the zero offsets are cached constants, the keys a view of the block table's first
    ``cdiv(max(seq), B)`` columns; only ``seq_lens`` and the positions are uploaded."""
    n = seq.shape[0]
    longest = int(seq.max())
    rows_t, tokens, offsets = constants.get(n)
    packed = np.empty((2, n), dtype=np.int64)  # seq_lens, positions
    packed[0] = seq
    np.subtract(seq, 1, out=packed[1])
    seq_t, positions = upload(packed, device).unbind(0)
    return make(
        req_indices=rows_t, query_len=1, max_seq_len=longest, min_seq_len=int(seq.min()),
        query_token_indices=tokens, query_positions=positions.unsqueeze(1), seq_lens=seq_t,
        key_block_ids=block_table[:n, : -(-longest // block_size)], key_offsets=offsets, min_key_offset=0,
        max_key_offset=0, key_block_columns=None, key_block_live=None, row_start=0)


def prefill_segments(make: Callable, block_table: torch.Tensor, rows: np.ndarray, qsl: np.ndarray,
                     seq: np.ndarray, query_lens: np.ndarray, block_size: int, window: int | None,
                     device: torch.device) -> list:
    """One segment per multi-token row (``rows``, ascending), from one vectorised pass.

    Row ``i`` with ``q`` query tokens and ``s`` keys: token rows ``qsl[i] .. qsl[i] + q -
    1`` at positions ``s - q .. s - 1``; keys from block ``f = 0`` (full attention) or
    ``f = num_skipped_blocks(s - q, W, B)`` (the first block its first query sees), over
    ``cdiv(s, B) - f`` blocks: block-table row ``i``, columns ``f ..``.
    """
    B, P = block_size, rows.shape[0]
    q = query_lens[rows].astype(np.int64)
    s = seq[rows].astype(np.int64)
    first = np.zeros(P, dtype=np.int64) if window is None else num_skipped_blocks(s - q, window, B)
    num_key_blocks = (s + B - 1) // B - first
    _, within = cumsum_and_arange(q)
    T = within.shape[0]
    packed = np.empty(3 * P + 2 * T, dtype=np.int64)  # rows, seq_lens, key offsets | token rows | positions
    packed[:P] = rows
    packed[P:2 * P] = s
    np.multiply(first, B, out=packed[2 * P:3 * P])
    np.add(within, np.repeat(qsl[rows], q), out=packed[3 * P:3 * P + T])
    np.add(within, np.repeat(s - q, q), out=packed[3 * P + T:])
    dev = upload(packed, device)
    per_row = dev[:3 * P].split(1)
    q_list = q.tolist()
    tokens = dev[3 * P:3 * P + T].view(1, T).split(q_list, dim=1)
    positions = dev[3 * P + T:].view(1, T).split(q_list, dim=1)
    segments = []
    for k, (i, ql, sl, f, nkb) in enumerate(zip(rows.tolist(), q_list, s.tolist(), first.tolist(),
                                                num_key_blocks.tolist())):
        segments.append(make(
            req_indices=per_row[k], query_len=ql, max_seq_len=sl, min_seq_len=sl,
            query_token_indices=tokens[k], query_positions=positions[k], seq_lens=per_row[P + k],
            key_block_ids=block_table[i:i + 1, f:f + nkb], key_offsets=per_row[2 * P + k],
            min_key_offset=f * B, max_key_offset=f * B, key_block_columns=None, key_block_live=None,
            row_start=i, col_start=f))
    return segments
