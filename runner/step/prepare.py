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

from attnplug.cache_groups.kinds import GroupKind
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.numpy_kernels import NumpyKernels
from attnplug.runner.step.prepare_buffers import PrepareBuffers
from attnplug.runner.step.spec_metadata import SpecDecodeMetadata
from attnplug.runner.step.step_kernels import StepKernels


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
    is_prefilling_cpu: torch.Tensor
    """``[R]`` ``torch.bool``, CPU: :attr:`is_prefilling` as a tensor (the same memory;
    ``CommonAttentionMetadata.is_prefilling``)."""
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
    inputs_embeds: torch.Tensor | None = None
    """``[P, hidden_size]`` model dtype, device: rows of prompt embeddings
    (``runner/step/prompt_embeds.py``), meaningful where :attr:`is_embed`; ``None`` in a
    step that schedules no prompt position of a request given embeddings."""
    is_embed: torch.Tensor | None = None
    """``[P]`` ``bool``, device: token ``t`` takes ``inputs_embeds[t]`` instead of
    embedding ``input_ids[t]``; ``None`` with :attr:`inputs_embeds`."""
    mrope_positions: torch.Tensor | None = None
    """``[3, P]`` ``int64``, device: M-RoPE positions (temporal, height, width) of a
    compiler built with ``uses_mrope`` (``runner/step/mrope.py``); ``None`` otherwise."""
    mm_slices: list | None = None
    """Images: per scheduled placeholder run, which rows of which image's encoder output
    its flat tokens take (``runner/step/multimodal.py``'s ``MMSlice``, host data); ``None``
    in a compiler without a ``MultiModalConfig`` or a step with no resident image."""


class InputPreparer:
    """Persistent buffers (:attr:`buffers`) and the step's ``prepare_inputs`` arithmetic,
    run by the step's kernels (``runner/step/kernels.py``).

    Args:
        max_num_reqs, max_model_len, max_num_batched_tokens: buffer sizes.
        device: where device tensors live.
        kernels: the step's kernels (default: the numpy ones).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 device: torch.device | str = "cpu", kernels: StepKernels | None = None):
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kernels: StepKernels = NumpyKernels() if kernels is None else kernels
        self.buffers = PrepareBuffers.allocate(max_num_reqs, max_model_len, max_num_batched_tokens, device)
        """The host/device buffers the kernels fill (:class:`~attnplug.runner.step.kernels.PrepareBuffers`)."""
        self.patch: tuple[int, bool, bool] = (0, True, False)
        """The asynchronous patch of the last :meth:`prepare` with ``prev_token_ids``: ``(k,
        contiguous, written)``, its plan ``buffers.patch_dest[:k]`` / ``patch_src[:k]``
        (not written when ``contiguous``: the plan is then ``arange(k)``)."""
        self._writes: tuple = (None, ())
        """``(group_kinds, per group whether it writes slots)`` of the last call."""
        self._cached_views: tuple | None = None
        """On a CPU device (buffers aliased: nothing to copy), the views of the last
        ``(batch, R, Q, P)``, reused while those sizes repeat (steady decode)."""

    def prepare(self, batch: InputBatch, group_kinds: list[str], num_tokens_padded: int | None = None,
                prev_token_ids: torch.Tensor | None = None, expected: int = -1, prev_host: int = -1) -> StepInputs:
        """Compute the step's inputs from ``batch`` (rows ``0 .. num_reqs-1``).

        Args:
            batch: the condensed batch, ``num_scheduled_tokens`` set for every row.
            group_kinds: per cache group, ``spec.kind`` (``"mamba"`` groups get no slots).
            num_tokens_padded: pad the token dimension to this length (CUDA graphs).
            prev_token_ids: asynchronous scheduling: the previous step's sampled tokens
                (``[n]`` integer, on the device), patched into this step's ``input_ids``
                in the same kernel call (``StepKernels.prepare_patched``: one pass on the
                compiled kernels; ``runner/step/placeholders.py``); the outcome goes to
                :attr:`patch`. ``None``: a synchronous step.
            expected: with ``prev_token_ids``, the token count the caller checks next
                (``-1``: none); a step that fails it is prepared but not patched.
            prev_host: ``StepKernels.host_tokens``' address of ``prev_token_ids``, or -1
                (it came through ``placeholders.prev_tokens_tensor``).

        Returns:
            The step's :class:`StepInputs` (``common_attn_metadata`` not yet built).

        Raises:
            IndexError: (compiled kernels) a row's positions leave the token table or its
                blocks: the step's validation excludes it; with ``patch``, a token index
                outside ``prev_host`` (nothing consumed).

        Host→device copies are non-blocking; nothing synchronises with the device.
        """
        R = batch.num_reqs
        sched = batch.num_scheduled_tokens[:R]
        ncc = batch.num_computed_tokens_cpu[:R]
        w = self._writes
        if w[0] != group_kinds:
            w = self._writes = (list(group_kinds), tuple(k != GroupKind.MAMBA for k in group_kinds))
        writes = w[1]
        if prev_token_ids is None:
            Q, max_query_len, max_seq_len = self.kernels.prepare(batch, self.buffers, writes, R, num_tokens_padded)
        else:
            out = self.kernels.prepare_patched(batch, self.buffers, writes, R, num_tokens_padded, prev_token_ids,
                                               expected, prev_host)
            Q, max_query_len, max_seq_len = out[0], out[1], out[2]
            self.patch = out[3:]
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
            bufs = self.buffers
            prefilling = bufs.is_prefilling[:R]
            views = (bufs.req_indices[:Q], bufs.discard[:R], (prefilling, torch.from_numpy(prefilling)),
                     slot_mappings, block_tables, self._buffer_views(R, P))
            self._cached_views = (key, views) if bufs.query_start_loc.aliased else None
        return self._step_inputs(batch, R, Q, P, max_query_len, max_seq_len, sched, ncc, *views)

    def _buffer_views(self, R: int, P: int) -> tuple[torch.Tensor, ...]:
        """Host → device copies of the step's prefixes; returns the device and host views
        (query_start_loc, positions, input_ids, seq_lens, logits_indices)."""
        b = self.buffers
        qsl, pos, sl, li = b.query_start_loc, b.positions, b.seq_lens, b.logits_indices
        return (qsl.copy_to_gpu(R + 1), qsl.cpu_view(R + 1), pos.copy_to_gpu(P), pos.cpu_view(P),
                b.input_ids.copy_to_gpu(P), sl.copy_to_gpu(R), sl.cpu_view(R), li.copy_to_gpu(R), li.cpu_view(R))

    def _step_inputs(self, batch, R, Q, P, max_query_len, max_seq_len, sched, ncc, req_indices, discard,
                     is_prefilling, slot_mappings, block_tables, buffer_views) -> StepInputs:
        """Wrap the filled buffers (``is_prefilling``: the mask's array and tensor views;
        ``buffer_views``: :meth:`_buffer_views`)."""
        qsl, qsl_cpu, pos, pos_cpu, ids, sl, sl_cpu, li, li_cpu = buffer_views
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
            is_prefilling=is_prefilling[0],
            is_prefilling_cpu=is_prefilling[1],
            slot_mapping=list(slot_mappings),  # own lists: the tensors may be shared with
            block_table_tensor=list(block_tables),  # the previous step's (cached views)
        )
