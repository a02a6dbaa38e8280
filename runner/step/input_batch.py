"""``InputBatch``: the columnar view of the requests in the current step.

One row per request, rows ``0 .. num_reqs-1`` compact after ``condense()``. A row is the
common key of many columns (docs/architecture.md): the ``[max_num_reqs, max_model_len]``
token table, the per-row counts, the sampling columns, the generators and one block-table
row per cache group. Every operation that moves a row moves all of them:
:attr:`InputBatch.row_columns` lists the 1-D columns, and ``_move_rows`` / ``swap_states``
are the only places rows move.

Row placement policy (the step compiler and its naive oracle both rely on it):

* ``add_request`` fills the lowest free hole left by ``remove_request``, else appends;
* ``condense()`` moves the last occupied row into the lowest hole, repeatedly;
* ``swap_states(i, j)`` exchanges two rows.

While a request holds a row its :class:`CachedRequestState` reads through to the row
(see ``attnplug.runner.step.request_state``).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np
import torch

from attnplug.cache_groups.block_table import MultiGroupBlockTable
from attnplug.core.errors import MetadataError
from attnplug.runner.step.numpy_kernels import NumpyKernels
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.step_kernels import StepKernels

_max_of = np.maximum.reduce
"""``ndarray.max`` without its Python wrapper (a new row's block-id bound)."""


class InputBatch:
    """Preallocated columns for up to ``max_num_reqs`` requests.

    Args:
        max_num_reqs: rows.
        max_model_len: tokens a request may hold (token table width).
        max_num_batched_tokens: tokens per step (slot-mapping buffers).
        block_sizes: manager block size per cache group.
        device: where block tables and slot mappings go.
        kernel_block_sizes: kernel block size per group (``None``: same as manager).
        kernels: the step's kernels (``runner/step/step_kernels.py``): row clears and moves of the
            block tables, rows of staged new requests. Default: the numpy kernels.

    Attributes (all CPU, row-indexed, valid for occupied rows):
        token_ids_cpu: ``[max_num_reqs, max_model_len]`` ``int32``; prompt then outputs
            (``token_ids_cpu_tensor`` is the torch view; not pinned: it is large).
        num_tokens: ``[max_num_reqs]`` ``int32``; tokens held (prompt + outputs).
        num_prompt_tokens: ``[max_num_reqs]`` ``int32``.
        num_computed_tokens_cpu: ``[max_num_reqs]`` ``int32``; tokens with cached K/V.
        num_scheduled_tokens: ``[max_num_reqs]`` ``int32``; this step's query lengths.
        num_computed_tokens_nulled: ``[max_num_reqs]`` ``int32``; how far the row's
            sliding-window blocks are nulled (see ``runner.step.apply_windows``).
        temperature, top_p: ``[max_num_reqs]`` ``float32``; top_k: ``int32``.
        generators: ``{row: torch.Generator}`` for seeded requests.
        block_table: the rows' block ids per cache group.
        req_id_to_index: ``{req_id: row}``; ``_req_ids[row]`` is its inverse.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 block_sizes: Sequence[int], device: torch.device | str = "cpu",
                 kernel_block_sizes: Sequence[int] | None = None, kernels: StepKernels | None = None):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu_tensor = torch.from_numpy(self.num_computed_tokens_cpu)
        self._ncc_view: tuple[int, torch.Tensor] = (-1, self.num_computed_tokens_cpu_tensor)
        self.num_scheduled_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_nulled = np.zeros(max_num_reqs, dtype=np.int32)
        """Per row, the ``num_computed_tokens`` up to which the sliding-window groups' skipped
        blocks are already ``NULL_BLOCK_ID`` in the row (0 for a row just filled); see
        ``attnplug.runner.step.apply_windows``."""
        self.prev_sampled_index = np.full(max_num_reqs, -1, dtype=np.int32)
        """Per row, the index of the row's token in the previous step's sampled tensor while
        that token is still only on the device (asynchronous scheduling), else -1; see
        ``runner/step/placeholders.py``."""
        self.prev_sampled_pos = np.zeros(max_num_reqs, dtype=np.int32)
        """Per row, the position of that token in the request (valid where
        ``prev_sampled_index >= 0``)."""
        self.num_prev_sampled = 0
        """How many placeholders the latest ``append_placeholders`` appended: the length of
        that step's sampled tensor, which ``prepare_inputs(prev_token_ids=...)`` must have
        (``runner/step/placeholders.py``)."""
        self.placeholders_appended = False
        """Whether ``append_placeholders`` ever ran on this batch: only then can the history
        hold a placeholder (every other token id is checked non-negative), so only then
        does the numpy ``prepare`` look for one (the compiled one always does, for free)."""
        self.num_spec_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        """Per row, the draft tokens it verifies this step (speculative decoding), held in
        ``token_ids_cpu`` after its ``num_tokens`` tokens (``spec_token_ids``); written at
        the end of stage 2 (``runner/step/spec_apply.py``), 0 outside such a step."""
        self.drafts_written = False
        """Whether ``num_spec_tokens`` may hold a count other than 0: set by stage 2's
        ``write_spec_tokens`` (the only writer of counts), so a step without drafts skips
        scanning the column."""
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.row_columns: tuple[np.ndarray, ...] = (
            self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu,
            self.num_scheduled_tokens, self.num_computed_tokens_nulled, self.prev_sampled_index,
            self.prev_sampled_pos, self.temperature, self.top_k, self.top_p)
        """Every 1-D per-row column; moved together by every row move."""
        self.generators: dict[int, torch.Generator] = {}
        self.block_table = MultiGroupBlockTable(block_sizes, max_num_reqs, max_model_len,
                                                max_num_batched_tokens, device, kernel_block_sizes)
        self.kernels: StepKernels = NumpyKernels() if kernels is None else kernels
        """The step's kernels (``runner/step/step_kernels.py``)."""
        self._req_ids: list[str | None] = [None] * max_num_reqs
        self._states: list[CachedRequestState | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self._num_rows = 0
        """Rows ``0 .. _num_rows-1`` may be occupied; holes among them are in ``_holes``."""
        self._holes: list[int] = []
        """Min-heap of free rows below ``_num_rows``."""
        self.layout = object()
        """Replaced whenever a request leaves its row (removed, moved, swapped); while it is
        the same object every request in the batch holds the row it held (``placeholders.py``'s
        ``fill_output_tokens`` trusts the rows ``append_placeholders`` recorded)."""

    # --- membership ---------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        """Requests in the batch."""
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids of rows ``0 .. num_reqs-1`` (call after ``condense``)."""
        return self._req_ids[:self.num_reqs]  # type: ignore[return-value]

    def num_computed_tokens_cpu_view(self, n: int) -> torch.Tensor:
        """``num_computed_tokens_cpu_tensor[:n]`` (cached while ``n`` is unchanged)."""
        if self._ncc_view[0] != n:
            self._ncc_view = (n, self.num_computed_tokens_cpu_tensor[:n])
        return self._ncc_view[1]

    def state_at(self, row: int) -> CachedRequestState | None:
        return self._states[row]

    @property
    def num_free_rows(self) -> int:
        return self.max_num_reqs - self.num_reqs

    def next_free_rows(self, n: int) -> list[int]:
        """The rows the next ``n`` ``add_request`` calls would use (lowest holes first)."""
        holes = sorted(self._holes)[:n]
        return holes + list(range(self._num_rows, self._num_rows + n - len(holes)))

    # --- adding and removing ------------------------------------------------------------
    def add_request(self, state: CachedRequestState) -> int:
        """Put a detached request into the lowest free row; return the row.

        Copies its tokens, counts, sampling params, generator and block ids into the row's
        columns; the state then reads through to the row.

        Raises:
            MetadataError: the batch is full, the request is already in it, or it holds
                more tokens than ``max_model_len`` (nothing changes).
        """
        return self.add_requests([state])[0]

    def add_requests(self, states: Sequence[CachedRequestState]) -> list[int]:
        """Batched :meth:`add_request`: rows are assigned in order, lowest free row first.

        Raises:
            MetadataError: as :meth:`add_request`, checked for all states before any is added.
        """
        if not states:
            return []
        seen = set()
        for st in states:
            if st.req_id in self.req_id_to_index or st._batch is not None or st.req_id in seen:
                raise MetadataError(f"request {st.req_id!r} is already in the batch; remove it first")
            seen.add(st.req_id)
            if st._token_ids_np.shape[0] > self.max_model_len:
                raise MetadataError(
                    f"request {st.req_id!r} holds {st._token_ids_np.shape[0]} tokens but max_model_len "
                    f"is {self.max_model_len}: raise max_model_len or shorten the request")
            for g, (bt, ids) in enumerate(zip(self.block_table, st._block_ids_np)):
                if ids.shape[0] > bt.max_num_blocks_per_req:
                    raise MetadataError(
                        f"request {st.req_id!r} has {ids.shape[0]} blocks in cache group {g} but a "
                        f"row holds at most {bt.max_num_blocks_per_req} (cdiv(max_model_len, block_size))")
        if len(states) > self.num_free_rows:
            raise MetadataError(
                f"input batch has {self.num_free_rows} free rows of {self.max_num_reqs}: cannot add "
                f"{len(states)} requests; the scheduler must not run more than max_num_reqs at once")
        rows = []
        toks = self.token_ids_cpu
        num_tokens, num_prompt, ncc = self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu
        sched, nulled = self.num_scheduled_tokens, self.num_computed_tokens_nulled
        temperature, top_k, top_p = self.temperature, self.top_k, self.top_p
        tables = self.block_table.block_tables
        holes, req_ids, row_states, index = self._holes, self._req_ids, self._states, self.req_id_to_index
        nblocks = self.block_table.num_blocks_per_row
        for st in states:
            if holes:
                row = heapq.heappop(holes)
            else:
                row = self._num_rows
                self._num_rows += 1
            rows.append(row)
            t = st._token_ids_np
            n = t.shape[0]
            toks[row, :n] = t
            num_tokens[row] = n
            num_prompt[row] = st._num_prompt_tokens
            ncc[row] = st._num_computed_tokens
            sched[row] = 0
            nulled[row] = 0
            self.prev_sampled_index[row] = -1
            sp = st.sampling_params
            temperature[row] = sp.temperature
            top_k[row] = sp.top_k
            top_p[row] = sp.top_p
            if st.generator is not None:
                self.generators[row] = st.generator
            for bt, ids, counts in zip(tables, st._block_ids_np, nblocks):
                if bt.kernel_blocks_per_block == 1:  # fill_vacant_row, inline (the common case)
                    n = ids.shape[0]
                    bt.block_table_np[row, :n] = ids
                    bt.block_id_bound[row] = _max_of(ids) if n else 0  # (kept with every write)
                    counts[row] = n
                else:
                    bt.fill_vacant_row(ids, row)  # vacant rows hold no blocks; capacity checked above
            req_ids[row] = st.req_id
            row_states[row] = st
            index[st.req_id] = row
            st._attach(self, row)
        return rows

    def admit_staged(self, new_reqs: Sequence, layout, requests: dict[str, CachedRequestState]) -> list[int]:
        """Admit fresh requests that the kernels' ``scan_new`` checked and staged.

        Rows are assigned as :meth:`add_requests` does (lowest free row first, in order);
        the kernels' ``write_new_rows`` writes tokens, counts, sampling columns and block
        ids; then each request gets its (attached) :class:`CachedRequestState`, also stored
        in ``requests``. The caller guarantees the ids are not in the batch and the rows
        suffice (stage 1 checked both).
        """
        rows = []
        holes = self._holes
        for _ in new_reqs:
            if holes:
                rows.append(heapq.heappop(holes))
            else:
                rows.append(self._num_rows)
                self._num_rows += 1
        self.kernels.write_new_rows(self, layout, rows)
        self.prev_sampled_index[rows] = -1
        req_ids, row_states, index = self._req_ids, self._states, self.req_id_to_index
        for nr, row in zip(new_reqs, rows):
            st = CachedRequestState._admitted(nr, self, row)
            rid = st.req_id
            requests[rid] = st
            req_ids[row] = rid
            row_states[row] = st
            index[rid] = row
            if st.generator is not None:
                self.generators[row] = st.generator
        return rows

    def remove_request(self, req_id: str, keep_state: bool = True) -> int | None:
        """Take ``req_id`` out of the batch, leaving a hole; return its old row.

        Args:
            req_id: the request.
            keep_state: write the row's values back into the request's state (it may
                return: unscheduled, preempted). ``False`` for a finished request, whose
                state is dropped (reading it afterwards raises).

        Returns:
            The freed row, or ``None`` when the request is not in the batch.
        """
        rows = self.remove_requests([req_id], keep_state)
        return rows[0] if rows else None

    def remove_requests(self, req_ids: Sequence[str], keep_state: bool = True) -> list[int]:
        """Batched :meth:`remove_request`; ids not in the batch are skipped.

        Returns:
            The freed rows of the requests that were in the batch.
        """
        rows = []
        index, row_states, ids = self.req_id_to_index, self._states, self._req_ids
        for rid in req_ids:
            row = index.pop(rid, None)
            if row is None:
                continue
            st = row_states[row]
            if keep_state:
                st._detach()
            else:
                st._drop()
            row_states[row] = None
            ids[row] = None
            if st.generator is not None:
                self.generators.pop(row, None)
            heapq.heappush(self._holes, row)
            rows.append(row)
        if rows:
            self.layout = object()
            self.kernels.clear_rows(self.block_table, rows)
        return rows

    # --- moving rows --------------------------------------------------------------------
    def _move_rows(self, srcs: list[int], dsts: list[int]) -> None:
        """Move occupied rows ``srcs`` into free rows ``dsts`` (disjoint); every column moves."""
        self.layout = object()
        s, d = np.asarray(srcs, dtype=np.int64), np.asarray(dsts, dtype=np.int64)
        toks, n_tok = self.token_ids_cpu, self.num_tokens
        for src, dst in zip(srcs, dsts):
            n = n_tok[src]
            toks[dst, :n] = toks[src, :n]
        for col in self.row_columns:
            col[d] = col[s]
        self.kernels.move_rows(self.block_table, srcs, dsts)
        for src, dst in zip(srcs, dsts):
            rid, st = self._req_ids[src], self._states[src]
            self._req_ids[dst], self._states[dst] = rid, st
            self._req_ids[src] = self._states[src] = None
            self.req_id_to_index[rid] = dst
            st._row = dst
            gen = self.generators.pop(src, None)
            if gen is not None:
                self.generators[dst] = gen

    def condense(self) -> list[tuple[int, int]]:
        """Close the holes: move the last occupied row into the lowest hole, repeatedly.

        Returns:
            The ``(src, dst)`` moves made, in order.
        """
        num_reqs = self.num_reqs
        dsts = [h for h in sorted(self._holes) if h < num_reqs]
        self._holes = []
        srcs = [r for r in range(self._num_rows - 1, num_reqs - 1, -1) if self._req_ids[r] is not None]
        assert len(srcs) == len(dsts), "condense: holes and tail rows out of sync"
        if srcs:
            self._move_rows(srcs, dsts)
        self._num_rows = num_reqs
        return list(zip(srcs, dsts))

    def swap_states(self, i: int, j: int) -> None:
        """Exchange rows ``i`` and ``j`` (both occupied); every column moves."""
        if i == j:
            return
        self.layout = object()
        toks = self.token_ids_cpu
        w = int(max(self.num_tokens[i], self.num_tokens[j]))
        toks[[i, j], :w] = toks[[j, i], :w]
        ij, ji = [i, j], [j, i]
        for col in self.row_columns:
            col[ij] = col[ji]
        self.block_table.swap_row(i, j)
        ri, rj = self._req_ids[i], self._req_ids[j]
        si, sj = self._states[i], self._states[j]
        self._req_ids[i], self._req_ids[j] = rj, ri
        self._states[i], self._states[j] = sj, si
        self.req_id_to_index[ri], self.req_id_to_index[rj] = j, i
        si._row, sj._row = j, i
        gi, gj = self.generators.pop(i, None), self.generators.pop(j, None)
        if gi is not None:
            self.generators[j] = gi
        if gj is not None:
            self.generators[i] = gj
