"""Null the runner's copy of sliding-window blocks that the block pool has freed.

The scheduler's block pool frees a sliding-window request's leading blocks once no
future query can see them (``attnplug.cache_groups.sliding_window``) and may hand them
to another request at once. It never tells the runner: the deltas only ever append block
ids. The runner derives the same set itself — logical blocks
``0 .. num_skipped_blocks(num_computed_tokens, W, B) - 1`` of every row
(``attnplug.cache_groups.sliding_window``) — and writes
``NULL_BLOCK_ID`` there, in the manager table and its kernel-block expansion, each step
before the block tables are committed. So a kernel that reads the block table can never
reach a freed (possibly reused) block, the block table never shifts (logical block ``i``
still covers tokens ``[i * B, (i + 1) * B)``), and the runner's block lists stay equal to
the scheduler's.

Cost: the column ``InputBatch.num_computed_tokens_nulled`` remembers, per row, up to
which ``num_computed_tokens`` the row is already nulled (it moves with its row and is 0
for a row just filled), so a step writes only the newly skipped blocks: a handful of
numpy calls per sliding-window group and no Python loop over rows or tokens. This is the
numpy kernels' ``null_skipped``; the compiled kernels do the same in one pass per group
(``BlockRows.null_skipped``, its rows include under ``runner/step/fast/``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from attnplug.cache_groups.ragged import cumsum_and_arange


def null_skipped_blocks(batch: Any, sliding_windows: Sequence[int | None]) -> int:
    """Write ``NULL_BLOCK_ID`` over the newly skipped blocks of rows ``0 .. num_reqs - 1``.

    Args:
        batch: the condensed ``InputBatch`` after ``update_states`` merged this step's deltas
            (``num_computed_tokens_cpu`` holds each row's context length this step).
        sliding_windows: per cache group, ``W`` tokens for a sliding-window group, ``None``
            for any other group (left untouched).

    Returns:
        The number of manager block entries nulled (all groups together).

    Afterwards ``batch.num_computed_tokens_nulled[:num_reqs] == num_computed_tokens_cpu``.
    Idempotent: a second call in the same step writes nothing.
    """
    R = batch.num_reqs
    if R == 0 or all(w is None for w in sliding_windows):
        return 0
    ncc = batch.num_computed_tokens_cpu[:R]
    done = batch.num_computed_tokens_nulled[:R]
    total = 0
    for bt, window in zip(batch.block_table, sliding_windows):
        if window is None:
            continue
        B = bt.block_size
        # num_skipped_blocks of ncc and of done, inline with in-place ops (few numpy calls):
        # max(0, n - W + 1) // B. hi <= num_blocks_per_row: the row's blocks hold seq_len > ncc.
        hi = ncc - (window - 1)
        np.maximum(hi, 0, out=hi)
        hi //= B
        lo = done - (window - 1)
        np.maximum(lo, 0, out=lo)
        lo //= B
        rows = np.flatnonzero(hi > lo)
        if rows.shape[0] == 0:
            continue
        lo_r = lo[rows]
        counts = hi[rows] - lo_r
        if counts.max() == 1:  # the usual case: each row crossed one block boundary
            bt.write_blocks(rows, lo_r)  # (None: the null id)
            total += int(rows.shape[0])
            continue
        _, offsets = cumsum_and_arange(counts)
        bt.write_blocks(np.repeat(rows, counts), np.repeat(lo_r, counts) + offsets)
        total += int(offsets.shape[0])
    done[:] = ncc
    return total
