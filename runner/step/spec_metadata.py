"""``SpecDecodeMetadata``: where a step's verification positions sit in its token stream.

A request verifying ``d`` drafts is scheduled ``1 + d`` tokens at the end of its query: its
last real token (whose logits give the distribution the first draft is checked against) then
the ``d`` drafts. Logits are needed at all ``1 + d`` positions: position ``j < d`` verifies
draft ``j``; position ``d`` gives the bonus token when every draft is accepted. A request
with ``d = 0`` is an ordinary row (one logits position, its last token).

Worked example (``query_start_loc = [0, 3, 4, 8]``, ``num_draft_tokens = [2, 0, 3]``):
request 0 has tokens 0..2 (one real + 2 drafts), request 1 token 3, request 2 tokens 4..7
(one real + 3 drafts)::

    logits_indices        = [0, 1, 2,  3,  4, 5, 6, 7]
    target_logits_indices = [0, 1,         4, 5, 6]      # rows of logits[logits_indices]
    bonus_logits_indices  = [2, 3, 7]
    cu_num_draft_tokens   = [2, 2, 5]
    draft_token_ids       = input_ids[[1, 2, 5, 6, 7]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from attnplug.core.errors import MetadataError
from attnplug.runner.step.numpy_spec import layout_arrays


@dataclass
class SpecDecodeMetadata:
    """The verification layout of one step (``R`` requests, ``D = sum(num_draft_tokens)``).

    All tensors are int64 on one device (the one ``build_spec_decode_metadata`` was given).

    Attributes:
        draft_token_ids: ``[D]``, the draft tokens to verify, request by request, in draft
            order (request ``i``'s are ``[cu_num_draft_tokens[i] - num_draft_tokens[i],
            cu_num_draft_tokens[i])``).
        num_draft_tokens: ``[R]`` host ``list[int]``, drafts of each request (``0`` = a row
            without speculation). A list, so the rejection sampler reads it without a sync.
        cu_num_draft_tokens: ``[R]``, inclusive cumulative sum of ``num_draft_tokens``.
        target_logits_indices: ``[D]``, rows of the gathered logits
            (``logits[logits_indices]``) that verify each draft: for draft ``j`` of request
            ``i``, the row of position ``j`` of its ``1 + d_i`` verification positions.
        bonus_logits_indices: ``[R]``, the row of each request's last position (its bonus
            token if all drafts are accepted, its only sampled token when ``d_i = 0``).
        logits_indices: ``[D + R]``, token-stream indices (into the step's flat tokens /
            hidden states) whose logits the model computes: the last ``1 + d_i`` tokens of
            every request, in request order. Replaces ``StepInputs.logits_indices`` (one per
            request) in a step with drafts.
    """

    draft_token_ids: torch.Tensor
    num_draft_tokens: list[int]
    cu_num_draft_tokens: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def max_spec_len(self) -> int:
        """The most drafts any request verifies this step (0 with none)."""
        return max(self.num_draft_tokens, default=0)


def _host_ints(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise MetadataError(f"{name} must be a 1-D integer sequence, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_counts(qsl: np.ndarray, counts: np.ndarray) -> None:
    if (counts < 0).any():
        i = int(np.flatnonzero(counts < 0)[0])
        raise MetadataError(f"num_draft_tokens[{i}] = {int(counts[i])} is negative")
    query_lens = np.diff(qsl)
    if (query_lens < 0).any():
        raise MetadataError("query_start_loc must not decrease")
    short = np.flatnonzero(query_lens < counts + 1)
    if short.size:
        i = int(short[0])
        raise MetadataError(f"row {i}: query length {int(query_lens[i])} < 1 + {int(counts[i])} drafts")


def _drafts(input_ids, draft_token_ids, positions: np.ndarray, counts: np.ndarray, device) -> torch.Tensor:
    """The ``[D]`` drafts: ``input_ids`` at ``positions``, or ``draft_token_ids`` flattened."""
    if input_ids is not None:
        if input_ids.dim() != 1:
            raise MetadataError(f"input_ids must be 1-D, got shape {tuple(input_ids.shape)}")
        pos = torch.from_numpy(positions).to(input_ids.device)
        return input_ids.index_select(0, pos).to(device=device, dtype=torch.int64)
    if len(draft_token_ids) != counts.shape[0]:
        raise MetadataError(f"draft_token_ids has {len(draft_token_ids)} rows for {counts.shape[0]} requests")
    flat: list[int] = []
    for i, row in enumerate(draft_token_ids):
        if len(row) != counts[i]:
            raise MetadataError(f"row {i}: {len(row)} draft ids for num_draft_tokens = {int(counts[i])}")
        flat.extend(int(t) for t in row)
    return torch.tensor(flat, dtype=torch.int64, device=device)


def build_spec_decode_metadata(query_start_loc: Sequence[int] | np.ndarray | torch.Tensor,
                               num_draft_tokens: Sequence[int] | np.ndarray,
                               input_ids: torch.Tensor | None = None,
                               draft_token_ids: Sequence[Sequence[int]] | None = None,
                               device: torch.device | str | None = None,
                               rows: Sequence[int] | np.ndarray | None = None) -> SpecDecodeMetadata:
    """Build the metadata from each row's query span and draft count.

    Args:
        query_start_loc: ``[R + 1]`` ints, row ``i``'s tokens are ``[qsl[i], qsl[i+1])`` of the
            flat token stream (``StepInputs.query_start_loc``; host values are read).
        num_draft_tokens: ``[R]`` ints ``>= 0``; row ``i``'s last ``d_i`` tokens are drafts.
        input_ids: ``[T]`` int tensor, the step's flat token ids; the drafts are read from it
            at their positions (on its device, no host sync).
        draft_token_ids: instead of ``input_ids``, the drafts per row (``len == d_i``).
            Exactly one of the two must be given.
        device: where the tensors go; default ``input_ids``' device, else CPU.
        rows: only these rows (ascending batch rows, e.g. the ones whose logits are not
            discarded); the metadata then has ``len(rows)`` requests, in this order.
            ``num_draft_tokens`` and ``draft_token_ids`` still describe every row.

    Returns:
        ``SpecDecodeMetadata`` (see its fields).

    Raises:
        MetadataError: shapes disagree, a count is negative, ``qsl`` decreases, a row's query is
            shorter than ``1 + d_i`` (the verifying row must also hold the token before the
            drafts), both or neither draft source given, or a row's draft list has the wrong
            length.
    """
    qsl = _host_ints(query_start_loc, "query_start_loc")
    counts = _host_ints(num_draft_tokens, "num_draft_tokens")
    R = counts.shape[0]
    if qsl.shape[0] != R + 1:
        raise MetadataError(f"query_start_loc has {qsl.shape[0]} entries, need num_reqs + 1 = {R + 1}")
    if (input_ids is None) == (draft_token_ids is None):
        raise MetadataError("give exactly one of input_ids and draft_token_ids")
    _check_counts(qsl, counts)
    if device is None:
        device = input_ids.device if input_ids is not None else "cpu"
    ends = qsl[1:]
    if rows is not None:
        sel = _host_ints(rows, "rows")
        if draft_token_ids is not None:
            draft_token_ids = [draft_token_ids[int(r)] for r in sel]
        ends, counts, R = ends[sel], counts[sel], sel.shape[0]

    arrays = layout_arrays(ends, counts)
    return _metadata(arrays, counts, _drafts(input_ids, draft_token_ids, arrays[3], counts, device), device)


def _metadata(arrays: tuple[np.ndarray, ...], counts: np.ndarray, drafts: torch.Tensor, device) -> SpecDecodeMetadata:
    logits_idx, target_idx, bonus_idx, _ = arrays
    return SpecDecodeMetadata(
        draft_token_ids=drafts,
        num_draft_tokens=counts.tolist(),
        cu_num_draft_tokens=_tensor(np.cumsum(counts), device),
        target_logits_indices=_tensor(target_idx, device),
        bonus_logits_indices=_tensor(bonus_idx, device),
        logits_indices=_tensor(logits_idx, device),
    )


def _tensor(a: np.ndarray, device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return t if t.device == torch.device(device) else t.to(device)


def spec_decode_metadata(kernels, batch, bufs, R: int) -> SpecDecodeMetadata | None:
    """The step's metadata (``prepare_inputs`` calls it when a row holds drafts), laid out
    by the step's kernels (``StepKernels.spec_layout``) into the persistent buffers
    ``bufs.spec_*`` (``PrepareBuffers``): the kept rows (``~discard``) of rows ``0 .. R - 1``,
    their draft counts ``batch.num_spec_tokens``, the drafts read from the host
    ``input_ids``. The tensors are device views of those buffers, valid until the next
    ``update_states`` (as ``StepInputs``' own). The inputs are the step compiler's own
    (validated in stage 1): no checks here. ``None`` when no kept row verifies drafts (on a
    validated step a verifying row is never discarded: none of rows ``0 .. R - 1`` does)."""
    k, D, counts = kernels.spec_layout(batch, bufs, R)
    if D == 0:
        return None
    views = bufs.spec_views.get((k, D))  # (only on a CPU device: there a copy is a view)
    if views is None:
        views = (bufs.spec_draft_ids.copy_to_gpu(D), bufs.spec_cu.copy_to_gpu(k), bufs.spec_target.copy_to_gpu(D),
                 bufs.spec_bonus.copy_to_gpu(k), bufs.spec_logits_indices.copy_to_gpu(D + k))
        if bufs.spec_draft_ids.aliased:
            if len(bufs.spec_views) >= 64:
                bufs.spec_views.clear()
            bufs.spec_views[(k, D)] = views
    return SpecDecodeMetadata(draft_token_ids=views[0], num_draft_tokens=counts, cu_num_draft_tokens=views[1],
                              target_logits_indices=views[2], bonus_logits_indices=views[3],
                              logits_indices=views[4])
