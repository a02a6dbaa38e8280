"""Stage 8, asynchronous: a sampled token that is still on the device.

With asynchronous scheduling (``docs/architecture.md``, "Asynchronous scheduling") step
t + 1 is prepared before step t's sampled tokens reach the host. The token history then
holds a placeholder (:data:`PLACEHOLDER_TOKEN_ID`) where each such token goes:

1. after step t samples, :func:`append_placeholders` appends one placeholder per sampling
   row and records, in the row's ``prev_sampled_index`` / ``prev_sampled_pos`` columns
   (which move with the row), where its token lies in step t's device tensor
   (vLLM's ``prev_req_id_to_index``, kept as a column so that condense and reorder carry it);
2. step t + 1's ``prepare_inputs`` gathers ``input_ids`` from the host history as usual
   (the placeholder included), then :func:`patch_input_ids` overwrites those entries on
   the device from step t's tensor: one slice copy when the rows kept their order (the
   steady state: row i's token is entry i), else one ``index_copy_``. The step's kernels
   plan it in the same call as the gather (``StepKernels.prepare_patched``,
   :func:`finish_patch`); on a CPU device they write the tokens themselves, and the
   compiled kernels then do not read the placeholders from the history;
3. when step t's outputs are read back, :func:`fill_output_tokens` writes the real
   tokens over the placeholders (the request may have moved, left the batch, or finished).

On the compiled kernels steps 1 and 3 are one checking pass and one writing pass each
(``StepKernels.append_placeholders`` / ``fill_placeholders``); when a check fails they
write nothing and decline, and the numpy code below runs and words the error.

A placeholder never reaches ``input_ids``: the patch overwrites it (one ``prepare_inputs``
of step t + 1 consumes the plan), or ``fill_output_tokens`` replaced it in the history
before. Any other placeholder among a step's tokens (a second patched prepare of the same
step, a prepare without ``prev_token_ids``, two steps in flight) is refused by
``prepare_inputs`` with a ``MetadataError`` naming the request (both kernels check the
tokens they read from the history), and nothing is consumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Sequence

import numpy as np
import torch

from attnplug.core.errors import MetadataError
from attnplug.runner.step.append import token_id_array
from attnplug.runner.step.check.types import row_indices, rows_distinct, show
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.prepare import StepInputs
from attnplug.runner.step.request_state import CachedRequestState

PLACEHOLDER_TOKEN_ID = -1
"""Stands in the host token history for a token still on the device (never a real id)."""


@dataclass(frozen=True)
class Placeholders:
    """The placeholders one step appended.

    Attributes:
        req_ids: the sampling requests, in the order of the step's sampled tensor.
        positions: ``[n]`` ``int64``, each placeholder's position in its request.
        rows: ``[n]`` ``int64``, each request's batch row when the placeholders were
            appended (``None``: unknown).
        layout: the batch's ``InputBatch.layout`` then: while the batch still holds that
            object no request has left its row, and ``fill_output_tokens`` writes into
            ``rows`` without looking the ids up.
    """

    req_ids: tuple[str, ...]
    positions: np.ndarray
    rows: np.ndarray | None = None
    layout: object = None


@dataclass(frozen=True)
class PatchPlan:
    """Where the previous step's device tokens go in this step's ``input_ids``.

    Attributes:
        dest: ``[k]`` ``int64`` flat token indices of this step.
        src: ``[k]`` ``int64`` indices into the previous step's sampled tensor.
        contiguous: ``dest == src == arange(k)`` (a slice copy suffices).
    """

    dest: np.ndarray
    src: np.ndarray
    contiguous: bool


def append_placeholders(batch: InputBatch, max_model_len: int, rows: np.ndarray) -> Placeholders:
    """Append one placeholder to each of ``rows`` (this step's sampling rows, batch row
    indices in the order of its sampled tensor, e.g. ``np.flatnonzero(~inputs.discard)``;
    ``inputs.req_ids[row]`` names each) and point their ``prev_sampled_*`` columns at it.

    ``rows``: a list or tuple of ints, or a 1-D integer numpy array (``check.types.row_indices``,
    the rule of every stage-8 call).

    Raises:
        MetadataError: ``rows`` of another type or shape (a 2-D array or a list of lists is
            not flattened; a scalar or a tensor), a row outside the batch or without a request
            (a hole before ``condense``), repeated, discarded
            this step (its ``seq_len`` does not reach ``num_tokens``), or already at
            ``max_model_len``.
    """
    R = batch.num_reqs
    rows = row_indices(rows, "append_placeholders")
    n = rows.shape[0]
    held = np.empty(n, np.int64)
    names = batch.kernels.append_placeholders(batch, rows, max_model_len, held)  # checks and writes, or declines
    if names is not None:
        batch.placeholders_appended = True
        batch.num_prev_sampled = n
        return Placeholders(names, held, rows.copy(), batch.layout)
    if n and (rows.min() < 0 or rows.max() >= R or not rows_distinct(rows, R)):
        raise MetadataError(f"append_placeholders: rows must be distinct and in [0, {R}), got {rows.tolist()}")
    order = np.arange(n, dtype=np.int32)
    ids = batch._req_ids  # row -> id (None in a hole); rows < R are checked above
    names = tuple(ids[:R]) if n == R and (rows == order).all() else tuple([ids[r] for r in rows.tolist()])
    if None in names:  # a hole left by remove_request before condense (update_states condenses)
        raise MetadataError(f"append_placeholders: row {int(rows[names.index(None)])} holds no request")
    held = batch.num_tokens[rows].astype(np.int64)
    seq = batch.num_computed_tokens_cpu[rows].astype(np.int64) + batch.num_scheduled_tokens[rows]
    if (seq != held).any() or (held >= max_model_len).any():
        i = int(np.argmax((seq != held) | (held >= max_model_len)))
        raise MetadataError(f"append_placeholders: request {names[i]!r} samples no token "
                            f"this step (seq_len {int(seq[i])}, num_tokens {int(held[i])}, max_model_len "
                            f"{max_model_len})")
    batch.placeholders_appended = True
    batch.num_prev_sampled = n
    batch.token_ids_cpu[rows, held] = PLACEHOLDER_TOKEN_ID
    batch.num_tokens[rows] = held + 1
    batch.prev_sampled_index[:R] = -1
    batch.prev_sampled_index[rows] = order
    batch.prev_sampled_pos[rows] = held
    return Placeholders(names, held, rows.copy(), batch.layout)


def prev_tokens_tensor(prev_token_ids, device: torch.device, num_placeholders: int) -> torch.Tensor:
    """``prepare_inputs``' ``prev_token_ids`` checked, before anything is read or consumed:
    a ``torch.Tensor``, 1-D, of an integer dtype other than ``bool``, on ``device`` (the
    step's) or on the CPU, holding exactly ``num_placeholders`` tokens (the latest
    :func:`append_placeholders`' count, ``InputBatch.num_prev_sampled``: that step's sampled
    tensor, one token per sampling row, as :func:`fill_output_tokens` takes it; a longer
    tensor, e.g. one entry per batch row with the discarded ones, would be read at the
    wrong entries). A CPU tensor that is not ``int64`` with unit stride comes back
    converted (one copy), so that on a CPU device the kernels read it on the host and check
    each value they take (in ``[0, 2**31)``); the values of a tensor on another device are
    not checked (that would wait for the device).

    Raises:
        MetadataError: anything else (numpy arrays and lists included, another length, a
            CPU tensor with elements but no memory: a zero tensor, a storage freed or
            resized to nothing).
    """
    t = prev_token_ids
    if type(t) is torch.Tensor and t.dtype is _INT64 and t.is_cpu and t.stride() == _UNIT_STRIDE:
        if t.shape[0] != num_placeholders:  # the usual CPU case: taken as it is
            raise _count_error(t, num_placeholders)
        return _with_memory(t)
    if not isinstance(t, torch.Tensor):
        raise MetadataError(f"prepare_inputs: prev_token_ids must be the previous step's sampled token ids as a "
                            f"1-D integer torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype is torch.bool or t.is_floating_point() or t.is_complex():
        raise MetadataError(f"prepare_inputs: prev_token_ids must be a 1-D integer tensor [n], got {t.dtype} "
                            f"of shape {tuple(t.shape)}")
    if t.shape[0] != num_placeholders:
        raise _count_error(t, num_placeholders)
    if t.is_cpu:  # one copy into a unit-stride int64 vector (``.contiguous()`` keeps the
        # stride of a one-element tensor, which the kernels would then not read on the host)
        return torch.empty(t.shape[0], dtype=_INT64).copy_(_with_memory(t))
    if t.device != device:
        raise MetadataError(f"prepare_inputs: prev_token_ids is on {t.device}, the step's tensors on {device}")
    return t


def _with_memory(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor), unless it has elements but no memory to read them from (its
    storage freed or resized to nothing), which is refused."""
    if t.shape[0] and not t.data_ptr():
        raise MetadataError("prepare_inputs: prev_token_ids holds no memory to read (a zero tensor, or its "
                            "storage freed or resized to nothing)")
    return t


def _count_error(t: torch.Tensor, n: int) -> MetadataError:
    return MetadataError(f"prepare_inputs: prev_token_ids holds {t.shape[0]} tokens but the latest "
                         f"append_placeholders appended {n} placeholders: pass that step's sampled tensor, "
                         "one token per sampling row in the order append_placeholders got")


_INT64 = torch.int64
_UNIT_STRIDE = (1,)


def finish_patch(bufs, patch: tuple[int, bool, bool], prev_token_ids: torch.Tensor,
                 input_ids: torch.Tensor) -> str | None:
    """Complete the patch the step's kernels planned with its ``prepare``
    (``StepKernels.prepare_patched``, into ``bufs.patch_*`` of ``PrepareBuffers``): when
    they did not write the tokens (``patch[2]``: not a CPU device, or not a contiguous 1-D
    ``int64`` CPU tensor), :func:`patch_input_ids` copies them on the device. The kernels
    already consumed the rows' ``prev_sampled_index``.

    Args:
        bufs: the step's ``PrepareBuffers``.
        patch: ``(k, contiguous, written)`` as the kernels returned it.
        prev_token_ids: ``[n]`` integer, on the device: the previous step's sampled tokens,
            in the order its ``append_placeholders`` got.
        input_ids: ``[P]`` ``int32``, device: this step's tokens.

    Returns:
        ``"slice"`` (rows kept their order: token ``i`` is entry ``i``), ``"scatter"``, or
        ``None`` when no token of this step is a placeholder.
    """
    k, contiguous, written = patch
    if k == 0:
        return None
    if not written:
        patch_input_ids(input_ids, PatchPlan(bufs.patch_dest[:k], bufs.patch_src[:k], contiguous), prev_token_ids)
    return "slice" if contiguous else "scatter"


def patch_input_ids(input_ids: torch.Tensor, plan: PatchPlan, prev_token_ids: torch.Tensor) -> None:
    """Write the previous step's device tokens into ``input_ids`` (``[P]`` ``int32``,
    device) as ``plan`` says; ``prev_token_ids``: ``[n]`` integer, same device. No host
    synchronisation: the index tensors are host data copied without blocking."""
    k = plan.dest.shape[0]
    if plan.contiguous:
        input_ids[:k].copy_(prev_token_ids[:k], non_blocking=True)
        return
    dev = input_ids.device
    dest = torch.from_numpy(plan.dest).to(dev, non_blocking=True)
    src = torch.from_numpy(plan.src).to(dev, non_blocking=True)
    input_ids.index_copy_(0, dest, prev_token_ids.index_select(0, src).to(input_ids.dtype))


def fill_output_tokens(batch: InputBatch, requests: dict[str, CachedRequestState], placeholders: Placeholders,
                       token_ids: Sequence[int]) -> int:
    """Write a step's real tokens over its placeholders, wherever the requests are now
    (a batch row, or detached state); a request that finished since is skipped.

    Args:
        token_ids: ``[n]``, one per placeholder, in order: a list of ints or a 1-D integer
            numpy array (stage 8's typing rule, ``append.token_id_array``: a tensor, e.g. the
            sampled tensor itself, is refused; pass ``.tolist()``).

    Returns:
        How many tokens were written.

    Raises:
        MetadataError: not one token per placeholder, a token id that is not an int in
            ``[0, 2**31)``, or a placeholder that is not there any more (filled twice).
            Everything is checked before anything is written: a refused call changes nothing.
    """
    n = len(placeholders.req_ids)
    try:
        m = len(token_ids)
    except TypeError:  # a scalar, a generator: no tokens to count
        raise MetadataError("fill_output_tokens: token ids must be ints in [0, 2**31), as a list or a 1-D "
                            f"integer array, got {show(token_ids)}") from None
    if m != n:
        raise MetadataError(f"fill_output_tokens: {m} tokens for {n} placeholders")
    if n == 0:
        return 0
    toks = token_id_array(batch.kernels, [token_ids], n, "fill_output_tokens", token_ids)
    written = batch.kernels.fill_placeholders(batch, requests, placeholders, toks)  # -1: declined
    if written >= 0:
        return written
    written = _fill_rows(batch, requests, placeholders, toks)
    if written is not None:
        return written
    targets = []  # (history, position, token), all checked before the first write
    for rid, pos, tok in zip(placeholders.req_ids, placeholders.positions.tolist(), toks.tolist()):
        st = requests.get(rid)
        if st is None:
            continue  # finished (its state is gone)
        row = st.row
        history = batch.token_ids_cpu[row] if row is not None else st.detached_token_ids()
        if pos >= history.shape[0] or history[pos] != PLACEHOLDER_TOKEN_ID:
            raise MetadataError(f"fill_output_tokens: request {rid!r} has no placeholder at position {pos}")
        targets.append((history, pos, tok))
    for history, pos, tok in targets:
        history[pos] = tok
    return len(targets)


def _fill_rows(batch: InputBatch, requests: dict[str, CachedRequestState], placeholders: Placeholders,
               toks: np.ndarray) -> int | None:
    """:func:`fill_output_tokens` when every request is still in the batch or finished and
    each placeholder is there (the usual case): one scatter of the checked ``[n]`` ``int64``
    ``toks``, into the rows ``append_placeholders`` recorded while no request has left its
    row since (``InputBatch.layout``), else into the rows the ids are found in. ``None``
    (nothing written) otherwise: the per-request loop then decides (a request that left the
    batch but not the runner) and words errors."""
    ids, pos = placeholders.req_ids, placeholders.positions
    n = len(ids)
    if placeholders.layout is batch.layout and placeholders.rows is not None:
        rows = placeholders.rows
    else:
        rows = np.fromiter(map(batch.req_id_to_index.get, ids, repeat(-1, n)), np.int64, n)
    if rows.min() < 0:  # finished ones are skipped; one that is detached takes the loop
        gone = np.flatnonzero(rows < 0).tolist()
        if any(ids[i] in requests for i in gone):
            return None
        kept = rows >= 0
        rows, pos, toks = rows[kept], pos[kept], toks[kept]
        if rows.shape[0] == 0:
            return 0
    table = batch.token_ids_cpu
    if pos.max() >= table.shape[1] or (table[rows, pos] != PLACEHOLDER_TOKEN_ID).any():
        return None
    table[rows, pos] = toks
    return int(rows.shape[0])
