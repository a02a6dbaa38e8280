"""Speculative decoding on a Mamba2 group: the verifying rows' layout and recurrence.

A verifying row (``CommonAttentionMetadata.num_draft_tokens_cpu[i] = d > 0``) computes
``1 + d`` tokens: its last real token, then ``d`` drafts. The rejection sampler accepts
``a <= d`` drafts *after* the forward, so the step keeps the state after every position:
the row's state slots are its first ``1 + d`` block-table columns (the Mamba group's
manager gives each request ``1 + k`` slots, ``KVCacheConfig.state_slots_per_request``)
and after the step **column ``j`` holds the state after the row's first ``j + 1`` tokens**
(the real token and ``j`` drafts). Column 0 is the request's own slot; the runner copies
column ``a`` into it once ``a`` is known (``runner/execute/spec_decode/state_commit.py``),
so rejected drafts leave no trace (their states stay in scratch slots no step reads).

Verifying rows run the recurrent (decode) update position by position: ``1 + max d``
vectorized steps over all verifying rows (vLLM keeps the intermediate states of its
decode kernel the same way). The other rows of the prefill part keep the chunked scan,
over a gathered token subset (``VerifyLayout.prefill_token_index``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnplug.cache_groups.ragged import cumsum_and_arange
from attnplug.core.errors import MetadataError


@dataclass(frozen=True)
class VerifyLayout:
    """Host index arrays of one step's verifying rows (all ``int64`` CPU numpy).

    ``Rv`` verifying rows, ``L = 1 + max d`` positions; the *grid* is ``[Rv, L]`` flattened
    row-major (entry ``i * L + t``: position ``t`` of verifying row ``i``).
    """

    verify_rows: np.ndarray
    """``[Rv]``: batch rows of the verifying rows (ascending)."""
    verify_token_index: np.ndarray
    """``[Rv * L]``: token (in the step's flat stream) at each grid entry; entries past a
    row's ``1 + d`` repeat its first token (computed, never written)."""
    verify_write_index: np.ndarray
    """``[Nw]``: the valid grid entries (``t < 1 + d_i``), ``Nw = sum(1 + d_i)``."""
    verify_write_bt_index: np.ndarray
    """``[Nw]``: flat block-table index ``row * width + t`` of each valid entry's state slot."""
    prefill_rows: np.ndarray
    """``[Pp]``: batch rows of the prefill part that do not verify."""
    prefill_token_index: np.ndarray
    """``[Tp]``: their tokens in the flat stream, row after row."""
    max_verify_len: int
    """``L``."""


def compute_verify_layout(query_start_loc: np.ndarray, num_draft_tokens: np.ndarray, num_decodes: int,
                          block_table_width: int) -> VerifyLayout:
    """Split the prefill part (rows ``num_decodes ..``) into verifying and plain rows.

    Args:
        query_start_loc: ``[num_reqs + 1]`` int64.
        num_draft_tokens: ``[num_reqs]`` int64 drafts per row.
        num_decodes: leading one-token rows (the decode part).
        block_table_width: columns of the group's block table.

    Raises:
        MetadataError: a verifying row among the decodes, a query length other than
            ``1 + d``, or more positions than block-table columns (state slots).

    Examples:
        >>> lay = compute_verify_layout(np.array([0, 1, 4, 9, 11]), np.array([0, 2, 0, 1]), 1, 4)
        >>> lay.verify_rows.tolist(), lay.verify_token_index.tolist(), lay.verify_write_index.tolist()
        ([1, 3], [1, 2, 3, 9, 10, 9], [0, 1, 2, 3, 4])
        >>> lay.verify_write_bt_index.tolist(), lay.prefill_token_index.tolist()
        ([4, 5, 6, 12, 13], [4, 5, 6, 7, 8])
    """
    qsl = query_start_loc
    R = qsl.shape[0] - 1
    d = num_draft_tokens[:R]
    q = np.diff(qsl)
    if (d[:num_decodes] > 0).any():
        raise MetadataError("num_draft_tokens_cpu: a one-token row cannot verify drafts (query length 1 + d)")
    rows = np.arange(num_decodes, R, dtype=np.int64)
    vm = d[num_decodes:] > 0
    vrows, prows = rows[vm], rows[~vm]
    lens = q[vrows]
    bad = np.flatnonzero(lens != 1 + d[vrows])
    if bad.shape[0]:
        r = int(vrows[bad[0]])
        raise MetadataError(f"row {r}: query length {int(q[r])} but {int(d[r])} drafts (a verifying row computes "
                            "its last real token, then the drafts: 1 + d tokens)")
    L = int(lens.max()) if lens.shape[0] else 0
    if L > block_table_width:
        raise MetadataError(f"verifying rows need {L} state slots (1 + drafts) but the Mamba group's block table "
                            f"has {block_table_width} columns")
    t = np.arange(L, dtype=np.int64)
    valid = t[None, :] < lens[:, None]
    grid = np.where(valid, qsl[vrows][:, None] + t[None, :], qsl[vrows][:, None]).reshape(-1)
    write = np.flatnonzero(valid.reshape(-1))
    bt = (vrows[:, None] * block_table_width + t[None, :]).reshape(-1)[write]
    plen = q[prows]
    _, offs = cumsum_and_arange(plen)
    ptok = np.repeat(qsl[prows], plen) + offs
    return VerifyLayout(vrows, grid.astype(np.int64), write.astype(np.int64), bt.astype(np.int64), prows,
                        ptok.astype(np.int64), L)
