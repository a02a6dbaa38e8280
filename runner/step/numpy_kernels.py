"""The numpy implementation of the step kernels (``runner/step/step_kernels.py``'s ``StepKernels``).

Vectorized numpy throughout, ``struct.pack_into`` for Python int lists; its scans always
decline (the vectorized checks of ``runner/step/check*.py`` plan every step).
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import numpy as np
import torch

from attnplug.cache_groups.ragged import cumsum_and_arange, repeat_indices
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.runner.step.apply_windows import null_skipped_blocks
from attnplug.runner.step.check.types import is_bool_like
from attnplug.runner.step.numpy_spec import check_no_placeholder, plan_patch_numpy, spec_layout_numpy, write_drafts_numpy

INT32_MAX = 2**31 - 1


class NumpyKernels:
    """The numpy implementation of :class:`StepKernels`."""

    name = "numpy"

    def pack_ints(self, seqs: list, out: np.ndarray) -> tuple[int, int, int]:
        # struct.pack_into converts Python ints at ~10 ns each (2x np.array(list)) and
        # rejects non-ints and values outside [0, 2**32); values >= 2**31 read back negative
        mv = memoryview(out).cast("B")
        lens, off = [], 0
        for i, s in enumerate(seqs):
            try:
                if isinstance(s, np.ndarray):
                    n = s.shape[0] if s.ndim == 1 else -1
                    if n < 0 or s.dtype.kind not in "iu":
                        return -(i + 1), 0, 0
                    if off + n > out.shape[0]:
                        return -(len(seqs) + 1), 0, 0
                    # values that fit int32 need no check here: negatives show in the final min
                    if n and (s.dtype.itemsize > 4 or s.dtype == np.uint32) and (
                            s.max() > INT32_MAX or (s.dtype.kind == "i" and s.min() < 0)):
                        return -(i + 1), 0, 0
                    out[off:off + n] = s
                elif not isinstance(s, (list, tuple)):  # a tensor, bytes, a range: not a token list
                    return -(i + 1), 0, 0
                else:
                    n = len(s)
                    if off + n > out.shape[0]:
                        return -(len(seqs) + 1), 0, 0
                    if n:
                        struct.pack_into(f"{n}I", mv, off * 4, *s)
            except (struct.error, TypeError, ValueError, OverflowError):
                return -(i + 1), 0, 0
            lens.append(n)
            off += n
        if not off:
            return 0, 0, 0
        flat = out[:off]
        lo, hi = int(flat.min()), int(flat.max())
        if lo <= 1:  # a bool packs as 0 or 1 (struct takes True, and a bool tensor, as 1): look at those entries
            bad = _first_bool(seqs, lens, flat)
            if bad is not None:
                return -(bad + 1), 0, 0
        if lo < 0:  # a value in [2**31, 2**32) read back negative: find its sequence
            ends = np.cumsum(lens)
            i = int(np.searchsorted(ends, int(np.argmax(flat < 0)), side="right"))
            return -(i + 1), 0, 0
        return off, lo, hi

    def scan_cached(self, batch, layout, bufs, d, finished):
        return None

    def scan_new(self, batch, layout, new_reqs, counts) -> bool:
        return False

    def write_new_rows(self, batch, layout, rows) -> None:
        raise RuntimeError("the numpy kernels stage no requests (scan_new declines)")

    def merge_cached(self, batch, plan, rows_c) -> None:
        merge_cached_numpy(batch, plan, rows_c)

    def clear_rows(self, table, rows) -> None:
        table.clear_rows(rows)

    def null_skipped(self, batch, windows) -> int:
        return null_skipped_blocks(batch, windows)

    def move_rows(self, table, srcs, dsts) -> None:
        table.move_rows(np.asarray(srcs, dtype=np.int64), np.asarray(dsts, dtype=np.int64))
        for bt in table:
            for src in srcs:
                bt.clear_row(src)

    def _prepare(self, batch, bufs, writes_slots, R, num_tokens_padded):
        sched = batch.num_scheduled_tokens[:R]
        ncc = batch.num_computed_tokens_cpu[:R]
        qsl = bufs.query_start_loc.np
        qsl[0] = 0
        np.add.accumulate(sched, dtype=np.int32, out=qsl[1:R + 1])
        Q = int(qsl[R])
        P = Q if num_tokens_padded is None else int(num_tokens_padded)
        pos = bufs.positions.np[:Q]
        flat = bufs.flat_idx[:Q]
        req_indices = bufs.req_indices[:Q]
        if Q == R:  # every row schedules one token (pure decode): token t is row t
            req_indices[:] = bufs.arange[:R]
            pos[:] = ncc
            np.add(bufs.row_starts[:R], pos, out=flat)
        else:
            req_indices[:] = repeat_indices(sched, bufs.arange)
            _, offsets = cumsum_and_arange(sched, bufs.arange)
            np.add(ncc[req_indices], offsets, out=pos)
            np.add(bufs.row_starts[req_indices], pos, out=flat)
        batch.token_ids_cpu.reshape(-1).take(flat, out=bufs.input_ids.np[:Q])  # one gather
        if P > Q:
            bufs.positions.np[Q:P] = 0
            bufs.input_ids.np[Q:P] = 0
        seq_lens = bufs.seq_lens.np[:R]
        np.add(ncc, sched, out=seq_lens)
        np.subtract(qsl[1:R + 1], 1, out=bufs.logits_indices.np[:R])
        np.less(seq_lens, batch.num_tokens[:R], out=bufs.discard[:R])
        np.less(ncc, batch.num_prompt_tokens[:R], out=bufs.is_prefilling[:R])
        split: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        rows = None if Q == R else req_indices
        for bt, writes in zip(batch.block_table, writes_slots):
            if not writes:  # a Mamba state group: no paged K/V
                bt.slot_mapping.np[:P] = PAD_SLOT_ID
                continue
            B = bt.block_size
            if B not in split:
                split[B] = np.divmod(pos, B)
            idx, off = split[B]
            bt.fill_slot_mapping(rows, pos, P, block_index=idx, block_offset=off)
        max_seq_len = int(seq_lens.max()) if R else 0
        max_query_len = (1 if Q == R else int(sched.max())) if R else 0
        return Q, max_query_len, max_seq_len

    def prepare(self, batch, bufs, writes_slots, R, num_tokens_padded):
        out = self._prepare(batch, bufs, writes_slots, R, num_tokens_padded)
        check_no_placeholder(batch, bufs, out[0])
        return out

    def write_drafts(self, batch, rows, lens, flat) -> None:
        write_drafts_numpy(batch, rows, lens, flat)

    def spec_layout(self, batch, bufs, R):
        return spec_layout_numpy(batch, bufs, R)

    def append_tokens(self, batch, rows, max_model_len, held, tokens) -> bool:
        return False  # append.py's numpy code does it (and words every refusal)

    def append_verified(self, batch, rows, max_model_len, token_ids) -> bool:
        return False  # spec_apply.py's numpy code does it (and words every refusal)

    def append_placeholders(self, batch, rows, max_model_len, held):
        return None  # placeholders.py's numpy code does it (and words every refusal)

    def fill_placeholders(self, batch, requests, placeholders, toks) -> int:
        return -1  # as append_placeholders

    def host_tokens(self, prev_token_ids, n: int) -> int:
        return -1  # numpy reads the tensor through prev_tokens_tensor's checks

    def prepare_patched(self, batch, bufs, writes_slots, R, num_tokens_padded, prev_token_ids, expected,
                        prev_host=-1):
        # two passes here (the compiled kernels fuse them): prepare, then the patch's plan
        Q, max_query_len, max_seq_len = self._prepare(batch, bufs, writes_slots, R, num_tokens_padded)
        if (expected >= 0 and Q != expected) or (num_tokens_padded is not None and num_tokens_padded < Q):
            return Q, max_query_len, max_seq_len, 0, True, False  # the caller refuses this step
        return (Q, max_query_len, max_seq_len) + plan_patch_numpy(
            batch, bufs, R, Q, prev_token_ids, writes_host_tokens(prev_token_ids, bufs))


def writes_host_tokens(prev_token_ids: torch.Tensor, bufs: Any) -> bool:
    """Whether the kernels write the previous step's tokens into the host ``input_ids``
    themselves (``StepKernels.prepare_patched``): the step's device buffers are its host
    buffers (``bufs.input_ids.aliased``: a CPU device) and ``prev_token_ids`` is a 1-D
    ``int64`` CPU tensor with unit stride (its elements back to back from ``data_ptr()``).
    Otherwise the caller copies them on the device (``placeholders.finish_patch``)."""
    t = prev_token_ids
    return bool(bufs.input_ids.aliased) and t.dtype is torch.int64 and t.is_cpu and t.stride() == (1,)


def merge_cached_numpy(batch: Any, plan: Any, rows_c: np.ndarray) -> None:
    """The numpy merge of a plan's cached deltas (see ``StepKernels.merge_cached``)."""
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


def _first_bool(seqs: Sequence, lens: list[int], flat: np.ndarray) -> int | None:
    """The first sequence (of lists/tuples packed into ``flat``) holding a bool of any kind
    (:func:`is_bool_like`): only entries that packed as 0 or 1 are looked at (a bool packs
    as nothing else)."""
    listed = np.fromiter((not isinstance(s, np.ndarray) for s in seqs), bool, len(seqs))
    if not listed.any():  # integer arrays hold no bool (a bool array is refused by its kind)
        return None
    where = np.flatnonzero(flat <= 1)
    if where.shape[0] == 0:
        return None
    ends = np.cumsum(lens)
    owners = np.searchsorted(ends, where, side="right")
    keep = listed[owners]
    where, owners = where[keep], owners[keep]
    starts = ends - np.asarray(lens, dtype=ends.dtype)
    for t, i in zip(where.tolist(), owners.tolist()):
        x = seqs[i][t - int(starts[i])]
        if type(x) is not int and is_bool_like(x):
            return i
    return None
