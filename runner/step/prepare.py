"""Stage 3 of a step: turn the (stable) batch layout into the step's flat token stream.

Runs after stage 2 (``runner/step/apply.py``) has finished every row move. From the
per-row ``num_scheduled_tokens`` it derives, with the shared cumsum/arange helper and no
Python loop over tokens (e.g. ``num_scheduled_tokens = [2, 5, 3]`` gives
``query_start_loc = [0, 2, 7, 10]``, ``req_indices = [0,0,1,1,1,1,1,2,2,2]``, offsets
within the request ``[0,1,0,1,2,3,4,0,1,2]``, ``logits_indices = [1, 6, 9]``):
``positions`` (``num_computed_tokens[req] + offset``), ``input_ids`` (one ``take`` from
the flattened token table into a persistent buffer), ``seq_lens``, the ``discard`` mask,
and each group's slot mapping and block table. Stage 4
(``runner/step/common_metadata.py``) wraps them in ``CommonAttentionMetadata``.

Every tensor in :class:`StepInputs` is a view of a persistent buffer: it stays valid
until the next ``update_states``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from attnplug.cache_groups.buffers import CpuGpuBuffer
from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.ragged import cumsum_and_arange, repeat_indices
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.fast.bind import bind_prepare
from attnplug.runner.step.spec_metadata import SpecDecodeMetadata


@dataclass
class StepInputs:
    """One step's model inputs and attention facts, rows in batch order.

    ``R`` = ``num_reqs``, ``Q`` = ``num_actual_tokens``, ``P`` = ``num_padded_tokens``
    (``>= Q``; tokens ``Q .. P-1`` are padding: position 0, token 0, ``PAD_SLOT_ID``).
    """

    req_ids: list[str]
    """The step's requests in row order."""
    num_reqs: int
    num_actual_tokens: int
    """``Q``: real scheduled tokens, ``sum(num_scheduled_tokens)``."""
    num_padded_tokens: int
    max_query_len: int
    max_seq_len: int
    num_scheduled_tokens: np.ndarray
    """``[R]`` ``int32``, CPU; query length per row."""
    num_computed_tokens: np.ndarray
    """``[R]`` ``int32``, CPU; tokens cached before this step (context length)."""
    num_tokens: np.ndarray
    """``[R]`` ``int32``, CPU; tokens each request holds (prompt + outputs)."""
    req_indices: np.ndarray
    """``[Q]`` ``int64``, CPU; the row of each token."""
    query_start_loc: torch.Tensor
    """``[R + 1]`` ``int32``, device; exclusive prefix sum of ``num_scheduled_tokens``."""
    query_start_loc_cpu: torch.Tensor
    """``[R + 1]`` ``int32``, CPU."""
    positions: torch.Tensor
    """``[P]`` ``int64``, device; ``num_computed_tokens[req] + offset within request``."""
    positions_cpu: torch.Tensor
    """``[P]`` ``int64``, CPU."""
    input_ids: torch.Tensor
    """``[P]`` ``int32``, device; ``token_ids_cpu[req, position]`` of each token."""
    seq_lens: torch.Tensor
    """``[R]`` ``int32``, device; ``num_computed_tokens + num_scheduled_tokens``."""
    seq_lens_cpu: torch.Tensor
    """``[R]`` ``int32``, CPU."""
    logits_indices: torch.Tensor
    """``[R]`` ``int64``, device; ``query_start_loc[1:] - 1``: each row's last token."""
    logits_indices_cpu: torch.Tensor
    """``[R]`` ``int64``, CPU."""
    discard: np.ndarray
    """``[R]`` ``bool``, CPU; row i's logits are discarded iff ``seq_lens[i] < num_tokens[i]``
    (a partial prefill or a recompute: the step does not reach the request's last token)."""
    is_prefilling: np.ndarray
    """``[R]`` ``bool``, CPU; ``num_computed_tokens < num_prompt_tokens``."""
    slot_mapping: list[torch.Tensor]
    """Per group: ``[P]`` ``int64``, device; ``PAD_SLOT_ID`` for padding (and for every
    token of a Mamba state group, which writes no paged K/V)."""
    block_table_tensor: list[torch.Tensor]
    """Per group: ``[R, max_num_blocks_per_req * k]`` ``int32``, device; kernel block ids."""
    common_attn_metadata: list[CommonAttentionMetadata] = field(default_factory=list)
    """Per group; group 0's object is the template, the others are ``replace`` copies."""
    spec_decode_metadata: SpecDecodeMetadata | None = None
    """Speculative decoding: the verification layout of the rows whose logits are kept,
    when some row verifies drafts this step (``runner/step/spec_metadata.py``); its
    ``logits_indices`` replace :attr:`logits_indices`. ``None`` in a step without drafts."""


class InputPreparer:
    """Persistent buffers and the vectorized arithmetic of ``prepare_inputs``.

    Args:
        max_num_reqs, max_model_len, max_num_batched_tokens: buffer sizes.
        device: where device tensors live.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 device: torch.device | str = "cpu", native: bool = False):
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.query_start_loc = CpuGpuBuffer((max_num_reqs + 1,), torch.int32, device)
        self.positions = CpuGpuBuffer((max_num_batched_tokens,), torch.int64, device)
        self.input_ids = CpuGpuBuffer((max_num_batched_tokens,), torch.int32, device)
        self.seq_lens = CpuGpuBuffer((max_num_reqs,), torch.int32, device)
        self.logits_indices = CpuGpuBuffer((max_num_reqs,), torch.int64, device)
        self._arange = np.arange(max(max_num_batched_tokens, max_num_reqs) + 1, dtype=np.int64)
        self._flat_idx_np = np.zeros(max_num_batched_tokens, dtype=np.int64)
        self._row_starts = np.arange(max_num_reqs, dtype=np.int64) * max_model_len
        self._req_indices = np.zeros(max_num_batched_tokens, dtype=np.int64)
        self._discard = np.zeros(max_num_reqs, dtype=bool)
        self._is_prefilling = np.zeros(max_num_reqs, dtype=bool)
        self._native = NATIVE if native else None
        self._cached_views: tuple | None = None
        """On a CPU device (buffers aliased: nothing to copy), the compiled path's views of
        the last ``(batch, R, Q, P)``, reused while those sizes repeat (steady decode)."""
        self._bound: tuple[InputBatch, tuple, object] | None = None
        """``(batch, group_kinds, NATIVE.Prepare)`` bound to that batch's columns."""

    def _native_for(self, batch: InputBatch, group_kinds: list[str]):
        """The compiled ``Prepare`` bound to ``batch`` (built on first use)."""
        kinds = tuple(group_kinds)
        if self._bound is None or self._bound[0] is not batch or self._bound[1] != kinds:
            prep = bind_prepare(batch, self, tuple(k != GroupKind.MAMBA for k in kinds))
            self._bound = (batch, kinds, prep)
        return self._bound[2]

    def prepare(self, batch: InputBatch, group_kinds: list[str],
                num_tokens_padded: int | None = None) -> StepInputs:
        """Compute the step's inputs from ``batch`` (rows ``0 .. num_reqs-1``).

        Args:
            batch: the condensed batch, ``num_scheduled_tokens`` set for every row.
            group_kinds: per cache group, ``spec.kind`` (``"mamba"`` groups get no slots).
            num_tokens_padded: pad the token dimension to this length (CUDA graphs).

        Returns:
            The step's :class:`StepInputs` (``common_attn_metadata`` not yet built).

        Host→device copies are non-blocking; nothing synchronises with the device.
        """
        R = batch.num_reqs
        sched = batch.num_scheduled_tokens[:R]
        ncc = batch.num_computed_tokens_cpu[:R]
        if self._native is not None:
            return self._prepare_native(batch, group_kinds, num_tokens_padded, R, sched, ncc)
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.add.accumulate(sched, dtype=np.int32, out=qsl[1:R + 1])
        Q = int(qsl[R])
        P = Q if num_tokens_padded is None else int(num_tokens_padded)
        pos = self.positions.np[:Q]
        flat = self._flat_idx_np[:Q]
        if Q == R:  # every row schedules one token (pure decode): token t is row t
            req_indices = self._arange[:R]
            pos[:] = ncc
            np.add(self._row_starts[:R], pos, out=flat)
        else:
            req_indices = repeat_indices(sched, self._arange)
            _, offsets = cumsum_and_arange(sched, self._arange)
            np.add(ncc[req_indices], offsets, out=pos)
            np.add(self._row_starts[req_indices], pos, out=flat)
        # index-select from the flattened token table into the persistent buffer
        batch.token_ids_cpu.reshape(-1).take(flat, out=self.input_ids.np[:Q])  # method: no wrapper
        if P > Q:
            self.positions.np[Q:P] = 0
            self.input_ids.np[Q:P] = 0
        seq_lens = self.seq_lens.np[:R]
        np.add(ncc, sched, out=seq_lens)
        np.subtract(qsl[1:R + 1], 1, out=self.logits_indices.np[:R])
        discard = np.less(seq_lens, batch.num_tokens[:R], out=self._discard[:R])
        is_prefilling = np.less(ncc, batch.num_prompt_tokens[:R], out=self._is_prefilling[:R])

        block_tables, slot_mappings = [], []
        split: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        rows = None if Q == R else req_indices
        for bt, kind in zip(batch.block_table, group_kinds):
            bt.commit(R)
            block_tables.append(bt.get_device_tensor(R))
            if kind is GroupKind.MAMBA:
                bt.slot_mapping.np[:P] = PAD_SLOT_ID
                slot_mappings.append(bt.slot_mapping.copy_to_gpu(P))
                continue
            B = bt.block_size
            if B not in split:
                split[B] = np.divmod(pos, B)
            idx, off = split[B]
            slot_mappings.append(bt.compute_slot_mapping(rows, pos, P, block_index=idx, block_offset=off))
        max_seq_len = int(seq_lens.max()) if R else 0
        max_query_len = (1 if Q == R else int(sched.max())) if R else 0
        return self._step_inputs(batch, R, Q, P, max_query_len, max_seq_len, sched, ncc, req_indices,
                                 discard, is_prefilling, slot_mappings, block_tables)

    def _prepare_native(self, batch: InputBatch, group_kinds: list[str], num_tokens_padded: int | None,
                        R: int, sched: np.ndarray, ncc: np.ndarray) -> StepInputs:
        """:meth:`prepare` through the compiled loop (``runner/step/fast/_native.pyx``)."""
        Q, max_query_len, max_seq_len = self._native_for(batch, group_kinds).prepare(
            R, -1 if num_tokens_padded is None else num_tokens_padded)
        P = Q if num_tokens_padded is None else int(num_tokens_padded)
        key = (batch, R, Q, P)
        if self._cached_views is not None and self._cached_views[0] == key:
            views = self._cached_views[1]  # CPU device: views of the same prefixes as last step
        else:
            block_tables, slot_mappings = [], []
            for bt in batch.block_table:
                bt.commit(R)
                block_tables.append(bt.get_device_tensor(R))
                slot_mappings.append(bt.slot_mapping.copy_to_gpu(P))
            views = (self._req_indices[:Q], self._discard[:R], self._is_prefilling[:R], slot_mappings, block_tables,
                     self._buffer_views(R, P))
            self._cached_views = (key, views) if self.query_start_loc.aliased else None
        return self._step_inputs(batch, R, Q, P, max_query_len, max_seq_len, sched, ncc, *views)

    def _buffer_views(self, R: int, P: int) -> tuple[torch.Tensor, ...]:
        """Host → device copies of the step's prefixes; returns the device and host views
        (query_start_loc, positions, input_ids, seq_lens, logits_indices)."""
        qsl, pos, sl, li = self.query_start_loc, self.positions, self.seq_lens, self.logits_indices
        return (qsl.copy_to_gpu(R + 1), qsl.cpu_view(R + 1), pos.copy_to_gpu(P), pos.cpu_view(P),
                self.input_ids.copy_to_gpu(P), sl.copy_to_gpu(R), sl.cpu_view(R), li.copy_to_gpu(R), li.cpu_view(R))

    def _step_inputs(self, batch, R, Q, P, max_query_len, max_seq_len, sched, ncc, req_indices, discard,
                     is_prefilling, slot_mappings, block_tables, buffer_views=None) -> StepInputs:
        """Wrap the filled buffers (``buffer_views``: :meth:`_buffer_views`, made here when ``None``)."""
        qsl, qsl_cpu, pos, pos_cpu, ids, sl, sl_cpu, li, li_cpu = buffer_views or self._buffer_views(R, P)
        return StepInputs(
            req_ids=batch.req_ids,
            num_reqs=R,
            num_actual_tokens=Q,
            num_padded_tokens=P,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_scheduled_tokens=sched,
            num_computed_tokens=ncc,
            num_tokens=batch.num_tokens[:R],
            req_indices=req_indices,
            query_start_loc=qsl,
            query_start_loc_cpu=qsl_cpu,
            positions=pos,
            positions_cpu=pos_cpu,
            input_ids=ids,
            seq_lens=sl,
            seq_lens_cpu=sl_cpu,
            logits_indices=li,
            logits_indices_cpu=li_cpu,
            discard=discard,
            is_prefilling=is_prefilling,
            slot_mapping=list(slot_mappings),  # own lists: the tensors may be shared with
            block_table_tensor=list(block_tables),  # the previous step's (cached views)
        )
