"""Index layout of a step's prefill part for the varlen causal conv1d and chunked SSD scan.

Pure numpy, computed once per step by the builder (no Python loop over tokens). The
prefill part is the packed stream of ``num_prefills`` sequences, sequence ``i`` holding
``query_lens[i]`` tokens at positions ``num_computed_tokens[i] ...`` of its request.

Chunks (the unit of the chunked scan) never straddle two sequences and are aligned to
*absolute* positions: a boundary falls wherever ``position % chunk_size == 0``. A
sequence that continues a chunked prefill at ``c % chunk_size != 0`` first gets a short
chunk of ``chunk_size - c % chunk_size`` tokens, then full chunks, then a partial one::

    chunk_size = 4, c = 6, q = 7:   positions 6 7 | 8 9 10 11 | 12
                                    chunk      0  |     1     |  2

Chunked layout: chunk ``k`` occupies rows ``k * chunk_size .. k * chunk_size +
chunk_size - 1`` of a padded ``[num_chunks * chunk_size]`` table; padding rows point at
index ``num_prefill_tokens`` (a zero row the scan appends). The inter-chunk recurrence
runs over a ``[num_prefills, max_chunks_per_seq]`` grid: chunk ``j`` of sequence ``i``
sits at grid index ``i * max_chunks_per_seq + j``.

The conv1d works on an *extended* stream: each sequence preceded by its
``conv_state_len = conv_kernel_size - 1`` state columns, so sequence ``i``'s token ``t``
sits at extended row ``t + (i + 1) * conv_state_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnplug.cache_groups.ragged import cumsum_and_arange


@dataclass(frozen=True)
class PrefillLayout:
    """Index arrays of one step's prefill part (all ``int64``, CPU numpy)."""

    query_start_loc: np.ndarray
    """``[num_prefills + 1]``: exclusive prefix sum of the query lengths (prefill tokens)."""
    seq_idx: np.ndarray
    """``[num_prefill_tokens]``: the sequence (0-based among prefills) of each token."""
    cu_chunk_seqlen: np.ndarray
    """``[num_chunks + 1]``: token offset of each chunk's first token; last = token count."""
    chunk_seq_idx: np.ndarray
    """``[num_chunks]``: the sequence of each chunk."""
    last_chunk_indices: np.ndarray
    """``[num_prefills]``: each sequence's last chunk (``-1`` for an empty sequence)."""
    chunk_grid_index: np.ndarray
    """``[num_chunks]``: ``seq * max_chunks_per_seq + j`` for chunk ``j`` of ``seq``."""
    chunk_token_index: np.ndarray
    """``[num_chunks * chunk_size]``: the token in each chunk row, ``num_prefill_tokens``
    for padding rows."""
    token_chunk_index: np.ndarray
    """``[num_prefill_tokens]``: each token's row in the chunk table (inverse of the above)."""
    conv_token_pos: np.ndarray
    """``[num_prefill_tokens]``: each token's row in the extended conv stream."""
    conv_state_pos: np.ndarray
    """``[num_prefills * conv_state_len]``: extended rows of each sequence's initial conv
    state columns (sequence-major, oldest first)."""
    conv_final_pos: np.ndarray
    """``[num_prefills * conv_state_len]``: extended rows that become each sequence's new
    conv state (its last ``conv_state_len`` inputs, initial columns included when the
    sequence is shorter)."""
    conv_window_pos: np.ndarray
    """``[num_prefill_tokens * (conv_state_len + 1)]``: per token, the extended rows of
    its conv window ``t - conv_state_len .. t`` (token-major)."""
    max_chunks_per_seq: int
    num_chunks: int


def compute_prefill_layout(query_lens: np.ndarray, num_computed_tokens: np.ndarray,
                           chunk_size: int, conv_state_len: int) -> PrefillLayout:
    """The :class:`PrefillLayout` of sequences with these lengths.

    Args:
        query_lens: ``[num_prefills]`` tokens scheduled per sequence (``>= 0``).
        num_computed_tokens: ``[num_prefills]`` tokens already computed (absolute position
            of each sequence's first token).
        chunk_size: tokens per scan chunk (``>= 1``).
        conv_state_len: ``conv_kernel_size - 1`` (``>= 0``).

    Returns:
        The layout (see the module docstring).

    Examples:
        >>> lay = compute_prefill_layout(np.array([7, 3]), np.array([6, 0]), 4, 3)
        >>> lay.cu_chunk_seqlen.tolist(), lay.chunk_seq_idx.tolist(), lay.max_chunks_per_seq
        ([0, 2, 6, 7, 10], [0, 0, 0, 1], 3)
    """
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(num_computed_tokens, dtype=np.int64)
    P = q.shape[0]
    cs = int(chunk_size)
    dm1 = int(conv_state_len)
    qsl = np.zeros(P + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    T = int(qsl[-1])
    seq_arange = np.arange(P, dtype=np.int64)
    seq_idx = np.repeat(seq_arange, q)

    first = np.minimum(q, cs - c % cs)
    n_chunks = (q > 0).astype(np.int64) + -(-(q - first) // cs)
    cu_n, j = cumsum_and_arange(n_chunks)
    K = int(cu_n[-1]) if P else 0
    chunk_seq = np.repeat(seq_arange, n_chunks)
    first_c, q_c = first[chunk_seq], q[chunk_seq]
    start_in_seq = np.where(j == 0, 0, first_c + (j - 1) * cs)
    end_in_seq = np.where(j == 0, first_c, np.minimum(start_in_seq + cs, q_c))
    chunk_len = end_in_seq - start_in_seq
    chunk_start = qsl[:-1][chunk_seq] + start_in_seq
    cu_chunk = np.append(chunk_start, T).astype(np.int64, copy=False)
    last_chunk = np.where(n_chunks > 0, cu_n - 1, -1).astype(np.int64, copy=False)
    M = int(n_chunks.max()) if P else 0
    grid = chunk_seq * M + j

    rows = np.arange(cs, dtype=np.int64)
    chunk_token = np.where(rows[None, :] < chunk_len[:, None], chunk_start[:, None] + rows[None, :], T).reshape(-1)
    token_chunk_of = np.repeat(np.arange(K, dtype=np.int64), chunk_len)
    _, off_in_chunk = cumsum_and_arange(chunk_len)
    token_chunk = token_chunk_of * cs + off_in_chunk

    conv_token = np.arange(T, dtype=np.int64) + (seq_idx + 1) * dm1
    cols = np.arange(dm1, dtype=np.int64)
    conv_state = ((qsl[:-1] + seq_arange * dm1)[:, None] + cols[None, :]).reshape(-1)
    conv_final = ((qsl[1:] + (seq_arange + 1) * dm1 - dm1)[:, None] + cols[None, :]).reshape(-1)
    taps = np.arange(-dm1, 1, dtype=np.int64)
    conv_window = (conv_token[:, None] + taps[None, :]).reshape(-1)
    return PrefillLayout(
        query_start_loc=qsl, seq_idx=seq_idx, cu_chunk_seqlen=cu_chunk, chunk_seq_idx=chunk_seq,
        last_chunk_indices=last_chunk, chunk_grid_index=grid.astype(np.int64, copy=False),
        chunk_token_index=chunk_token.astype(np.int64, copy=False),
        token_chunk_index=token_chunk.astype(np.int64, copy=False),
        conv_token_pos=conv_token, conv_state_pos=conv_state, conv_final_pos=conv_final,
        conv_window_pos=conv_window, max_chunks_per_seq=M, num_chunks=K)


def max_num_chunks(max_num_reqs: int, max_num_batched_tokens: int, chunk_size: int) -> int:
    """Upper bound of ``num_chunks`` in one step: every sequence may open with a short
    chunk and end with a partial one, and chunks are never empty."""
    return min(max_num_batched_tokens, 2 * max_num_reqs + max_num_batched_tokens // chunk_size)
