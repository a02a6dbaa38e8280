"""The numpy kernels of speculative decoding's drafts and of the asynchronous patch
(``StepKernels.write_drafts`` / ``spec_layout`` / ``prepare_patched``'s patch, ``runner/step/step_kernels.py``).

The layout of a step with drafts (``runner/step/spec_metadata.py`` has a worked example): a
kept row ending (exclusive) at token ``e`` with ``d`` drafts owns ``1 + d`` logits rows,
whose token indices are ``e - 1 - d .. e - 1``; the first ``d`` of them verify its drafts
(``target_logits_indices``), the last gives the bonus token (``bonus_logits_indices``); its
drafts sit at ``e - d .. e - 1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnplug.cache_groups.ragged import cumsum_and_arange
from attnplug.core.errors import MetadataError


def layout_arrays(ends: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(logits_indices, target_logits_indices, bonus_logits_indices, draft positions)``
    (``int64``) for rows ending at ``ends`` (``[R]``, exclusive token indices) with
    ``counts`` (``[R]``, validated) drafts each."""
    R = counts.shape[0]
    if R and (counts == counts[0]).all():  # the same d everywhere (the usual step): 2-D, no repeat
        d = int(counts[0])
        w = d + 1
        grid = np.arange(R * w, dtype=np.int64).reshape(R, w)
        logits_2d = ends[:, None] - w + grid[0]
        return (logits_2d.ravel(), grid[:, :d].ravel(), grid[:, d].copy(), (logits_2d[:, :d] + 1).ravel())
    per_row = counts + 1                         # logits positions per row
    cu_logits = np.cumsum(per_row)               # end (exclusive) of each row's logits rows
    total = int(cu_logits[-1]) if cu_logits.shape[0] else 0
    # logits row t of row i is position t + (ends[i] - cu_logits[i])
    logits_idx = np.repeat(ends - cu_logits, per_row)
    logits_idx += np.arange(total, dtype=np.int64)
    bonus_idx = cu_logits - 1
    is_target = np.ones(total, dtype=bool)
    is_target[bonus_idx] = False
    target_idx = np.flatnonzero(is_target)
    return logits_idx, target_idx, bonus_idx, logits_idx[target_idx] + 1


def write_drafts_numpy(batch: Any, rows: np.ndarray | None, lens: np.ndarray | None,
                       flat: np.ndarray | None) -> None:
    """``StepKernels.write_drafts`` in numpy (one scatter into the token table)."""
    batch.num_spec_tokens[:] = 0
    if rows is None or rows.shape[0] == 0:
        return
    held = batch.num_tokens[rows]
    d = int(lens[0])
    if lens.shape[0] * d == flat.shape[0] and (lens == d).all():  # the same d everywhere
        cols = held[:, None] + np.arange(d, dtype=np.int64)
        batch.token_ids_cpu[rows[:, None], cols] = flat.reshape(-1, d)
    else:
        _, offsets = cumsum_and_arange(lens)
        batch.token_ids_cpu[np.repeat(rows, lens), np.repeat(held, lens) + offsets] = flat
    batch.num_spec_tokens[rows] = lens


def spec_layout_numpy(batch: Any, bufs: Any, R: int) -> tuple[int, int, list[int]]:
    """``StepKernels.spec_layout`` in numpy (:func:`layout_arrays` into ``bufs.spec_*``)."""
    ends = bufs.query_start_loc.np[1:R + 1].astype(np.int64)
    counts = batch.num_spec_tokens[:R].astype(np.int64)
    discard = bufs.discard[:R]
    if discard.any():
        keep = np.flatnonzero(~discard)
        ends, counts = ends[keep], counts[keep]
    logits, target, bonus, positions = layout_arrays(ends, counts)
    k, D = counts.shape[0], target.shape[0]
    bufs.spec_logits_indices.np[:logits.shape[0]] = logits
    bufs.spec_target.np[:D] = target
    bufs.spec_bonus.np[:k] = bonus
    np.cumsum(counts, out=bufs.spec_cu.np[:k])
    bufs.spec_draft_ids.np[:D] = bufs.input_ids.np[positions]
    return k, D, counts.tolist()


def plan_patch_numpy(batch: Any, bufs: Any, R: int, Q: int, prev_token_ids: torch.Tensor,
                     written: bool) -> tuple[int, bool, bool]:
    """The patch of ``StepKernels.prepare_patched`` in numpy, after ``prepare`` gathered
    the ``Q`` tokens (a second pass; ``written``: write ``prev_token_ids``, a 1-D ``int64``
    CPU tensor, into the host ``input_ids``). Returns ``(k, contiguous, written)``.

    Raises:
        MetadataError: as ``StepKernels.prepare_patched``, before any column is consumed."""
    src_col = batch.prev_sampled_index[:R]
    ids = bufs.input_ids.np[:Q]
    if R == 0 or src_col.max() < 0:
        _check_no_placeholder(batch, bufs, ids, None)
        return 0, True, False
    # offset of the placeholder within the row's scheduled tokens (e.g. 0 for a decode)
    ncc = batch.num_computed_tokens_cpu[:R]
    offset = batch.prev_sampled_pos[:R] - ncc
    hit = (src_col >= 0) & (offset >= 0) & (offset < batch.num_scheduled_tokens[:R])
    rows = np.flatnonzero(hit)
    k = rows.shape[0]
    src, dest = bufs.patch_src[:k], bufs.patch_dest[:k]
    src[:] = src_col[rows]
    np.add(bufs.query_start_loc.np[rows], offset[rows], out=dest)
    contiguous = bool(k == 0 or (dest[-1] == k - 1 and src[-1] == k - 1 and (dest == bufs.arange[:k]).all()
                                 and (src == dest).all()))
    n = prev_token_ids.shape[0]
    if k and src.max() >= n:
        raise prev_token_error(f"holds {n} tokens but a placeholder takes entry {int(src.max())}")
    written = written and k > 0
    if written:
        vals = prev_token_ids.numpy()[src]
        bad = np.flatnonzero((vals < 0) | (vals >= 2**31))
        if bad.shape[0]:
            j = int(bad[0])
            raise prev_token_error(f"entry {int(src[j])} is {int(vals[j])}, not a token id in [0, 2**31)")
        _check_no_placeholder(batch, bufs, ids, dest)
        ids[dest] = vals
    else:
        _check_no_placeholder(batch, bufs, ids, dest if k else None)
    src_col[:] = -1  # consumed (after every check: an error changes no column)
    if k:
        bufs.patch_steps[0 if contiguous else 1] += 1
    return k, contiguous, written


def check_no_placeholder(batch: Any, bufs: Any, Q: int) -> None:
    """The numpy ``prepare``'s check of its ``Q`` gathered tokens (only once the batch ever
    held placeholders: ``InputBatch.placeholders_appended``)."""
    if batch.placeholders_appended:
        _check_no_placeholder(batch, bufs, bufs.input_ids.np[:Q], None)


def _check_no_placeholder(batch: Any, bufs: Any, ids: np.ndarray, patched: np.ndarray | None) -> None:
    """Raise :func:`placeholder_read_error` for the first of ``ids`` (the step's gathered
    tokens) that is a placeholder, the ``patched`` indices excepted."""
    neg = ids < 0
    if patched is not None:
        neg[patched] = False
    if neg.any():
        raise placeholder_read_error(batch, bufs, int(np.argmax(neg)))


def placeholder_read_error(batch: Any, bufs: Any, t: int) -> MetadataError:
    """The error for the step's token ``t``, read from the history, being a placeholder:
    both kernels word it here (``bufs.req_indices`` / ``bufs.positions`` hold its row and
    position)."""
    row, pos = int(bufs.req_indices[t]), int(bufs.positions.np[t])
    return MetadataError(
        f"prepare_inputs: request {batch.req_ids[row]!r}: its token at position {pos} is a placeholder whose "
        "sampled token was neither given nor filled: pass the previous step's sampled tokens as "
        "prev_token_ids (one prepare_inputs of the step consumes them), or fill_output_tokens first")


def prev_token_error(detail: str) -> MetadataError:
    """The error for ``prev_token_ids`` that the patch cannot take (both kernels)."""
    return MetadataError(f"prepare_inputs: prev_token_ids {detail}")
