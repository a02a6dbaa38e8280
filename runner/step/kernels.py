"""The compiled step kernels (:class:`CompiledKernels`, the Cython loops of
``runner/step/fast/``) and the choice between them and the numpy ones (:func:`choose_kernels`);
the interface both implement is ``step_kernels.StepKernels``, which says what each
operation does.

Only this module and ``compiler.py`` import ``runner.step.fast`` (``tests/test_layers.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.numpy_kernels import NumpyKernels, merge_cached_numpy, writes_host_tokens
from attnplug.runner.step.numpy_spec import placeholder_read_error, prev_token_error
from attnplug.runner.step.plan import ScanBuffers
from attnplug.runner.step.prepare_buffers import PrepareBuffers
from attnplug.runner.step.step_kernels import StepKernels


class CompiledKernels:
    """The compiled implementation of :class:`StepKernels` (``runner/step/fast/``).

    Each compiled object holds typed views of the numpy arrays it reads and writes; they
    are bound on first use and rebound when the batch (or table, or buffers) changes.
    """

    name = "compiled"

    def __init__(self, sampling_params_cls: type):
        if NATIVE is None:
            raise RuntimeError("the compiled step kernels are not built (pip install -e . builds them)")
        self._numpy = NumpyKernels()
        self._sp_cls = sampling_params_cls
        NATIVE.bind_tensor_type(torch.Tensor)  # (else host_tokens answers -1: the general checks)
        self.host_tokens = NATIVE.host_int64_vector  # a C function: no Python frame per call
        self._rows: tuple[Any, Any, list[int]] | None = None
        self._cached: tuple[Any, Any, Any] | None = None
        self._new: tuple[Any, Any] | None = None
        self._prep: tuple[Any, Any, Any, Any] | None = None
        self._drafts: tuple[Any, Any] | None = None
        self._stage8: tuple[Any, Any] | None = None
        self._spec: tuple[Any, Any, Any] | None = None
        self._scan_bufs: ScanBuffers | None = None
        self._merge_bound: tuple | None = None

    # --- binding ---------------------------------------------------------------------------
    def _row_ops(self, table):
        if self._rows is None or self._rows[0] is not table:
            tabs = table.block_tables
            self._rows = (table, NATIVE.BlockRows(table.num_blocks_per_row, table.block_id_bound, [bt.block_table_np for bt in tabs],
                                                  [bt.kernel_block_table.np for bt in tabs],
                                                  [bt.kernel_blocks_per_block for bt in tabs]),
                          [bt.block_size for bt in tabs])
        return self._rows[1]

    def _cached_scan(self, batch, layout, bufs: ScanBuffers):
        c = self._cached
        if c is not None and c[0] is batch and c[1] is bufs:
            return c[2]
        tabs = batch.block_table.block_tables
        scan = NATIVE.CachedScan(
            batch.num_tokens, batch.num_computed_tokens_nulled, batch.block_table.num_blocks_per_row,
            batch.block_table.block_id_bound, [bt.block_table_np for bt in tabs], layout.capacity_col[:, 0], layout.num_blocks_per_group,
            layout.null_block_allowed, layout.max_model_len, bufs.rows, bufs.ncts, bufs.counts, bufs.app_sel,
            bufs.app_start, bufs.app_len, bufs.app_ids, bufs.app_total, bufs.app_after, bufs.app_flat,
            bufs.spec_sel, bufs.spec_rows, bufs.spec_lens, bufs.spec_ids)
        self._cached = (batch, bufs, scan)
        self._scan_bufs = bufs
        return scan

    def _new_scan(self, batch, layout):
        if self._new is None or self._new[0] is not batch:
            b, tabs = batch, batch.block_table.block_tables
            scan = NATIVE.NewScan(
                b.token_ids_cpu, b.num_tokens, b.num_prompt_tokens, b.num_computed_tokens_cpu,
                b.num_scheduled_tokens, b.num_computed_tokens_nulled, b.temperature, b.top_k, b.top_p,
                b.block_table.num_blocks_per_row, b.block_table.block_id_bound, [bt.block_table_np for bt in tabs],
                [bt.kernel_block_table.np for bt in tabs], [bt.kernel_blocks_per_block for bt in tabs],
                layout.capacity_col[:, 0],  # a Mamba group: max_model_len, so it needs one state slot
                layout.num_blocks_per_group, self._sp_cls)
            self._new = (batch, scan)
        return self._new[1]

    def _prepare_loop(self, batch, bufs: PrepareBuffers, writes_slots: tuple[bool, ...]):
        p = self._prep
        if p is not None and p[0] is batch and p[1] is bufs and p[2] == writes_slots:
            return p[3]
        tabs = list(batch.block_table)
        prep = NATIVE.Prepare(
            batch.num_scheduled_tokens, batch.num_computed_tokens_cpu, batch.num_tokens,
            batch.num_prompt_tokens, batch.token_ids_cpu, bufs.query_start_loc.np, bufs.positions.np,
            bufs.input_ids.np, bufs.seq_lens.np, bufs.logits_indices.np, bufs.req_indices, bufs.discard,
            bufs.is_prefilling, [bt.block_table_np if w else None for bt, w in zip(tabs, writes_slots)],
            [bt.slot_mapping.np for bt in tabs], [bt.block_size for bt in tabs])
        prep.bind_patch(batch.prev_sampled_index, batch.prev_sampled_pos, bufs.patch_dest, bufs.patch_src,
                        bufs.patch_steps)
        self._prep = (batch, bufs, writes_slots, prep)
        return prep

    # --- the operations --------------------------------------------------------------------
    def pack_ints(self, seqs: list, out: np.ndarray) -> tuple[int, int, int]:
        res = NATIVE.pack_int32(seqs, out)
        if res[0] >= 0:
            return res
        return self._numpy.pack_ints(seqs, out)  # numpy arrays, or a bad value: numpy decides

    def scan_cached(self, batch, layout, bufs, d, finished):
        scan = self._cached_scan(batch, layout, bufs)
        c = d.scheduled_cached_reqs
        try:
            ok = scan.scan(c.req_ids, batch.req_id_to_index, c.num_computed_tokens, d.num_scheduled_tokens,
                           c.new_token_ids, c.new_block_ids, c.resumed_from_preemption, finished,
                           d.spec_decode_tokens, d.packed)
        except TypeError:  # a field that is not a list (e.g. a tuple): irregular
            return None
        return scan if ok else None

    def scan_new(self, batch, layout, new_reqs, counts) -> bool:
        return self._new_scan(batch, layout).scan(new_reqs, counts)

    def write_new_rows(self, batch, layout, rows) -> None:
        self._new_scan(batch, layout).write_rows(rows)

    def merge_cached(self, batch, plan, rows_c) -> None:
        if plan.token_deltas or plan.resumed:  # (the vectorized checks' plans only)
            merge_cached_numpy(batch, plan, rows_c)
            return
        ap = plan.appends
        ops = self._row_ops(batch.block_table)
        sb = self._scan_bufs
        if sb is not None and rows_c.base is sb.rows and (ap is None or ap.flat.base is sb.app_flat):
            # the cached scan's plan: its arrays are the bound buffers' prefixes
            mb = self._merge_bound
            if mb is None or mb[0] is not ops or mb[1] is not sb or mb[2] is not batch:
                ops.bind_scan(batch.num_computed_tokens_cpu, batch.num_scheduled_tokens, sb.rows, sb.ncts,
                              sb.counts, sb.app_sel, sb.app_start, sb.app_len, sb.app_flat)
                self._merge_bound = (ops, sb, batch)
            ops.merge_scan(rows_c.shape[0], 0 if ap is None else ap.sel.shape[0], ap is None or ap.one_each)
            return
        if ap is None:
            ops.merge(batch.num_computed_tokens_cpu, batch.num_scheduled_tokens, rows_c, plan.ncts_c,
                      plan.counts_c, _NO_SEL, _NO_STARTS, None, _NO_IDS, True)
        else:
            i64 = np.int64  # (the vectorized checks' starts are int32; the scan's int64 views)
            ops.merge(batch.num_computed_tokens_cpu, batch.num_scheduled_tokens, rows_c, plan.ncts_c,
                      plan.counts_c, ap.sel, np.asarray(ap.starts, dtype=i64),
                      None if ap.one_each else np.asarray(ap.lens, dtype=i64), ap.flat, ap.one_each)

    def clear_rows(self, table, rows) -> None:
        self._row_ops(table).clear_rows(rows)

    def move_rows(self, table, srcs, dsts) -> None:
        self._row_ops(table).move_rows(srcs, dsts)

    def null_skipped(self, batch, windows) -> int:
        ops = self._row_ops(batch.block_table)  # (binds self._rows: its third entry, the block sizes)
        return ops.null_skipped(batch.num_computed_tokens_cpu, batch.num_computed_tokens_nulled, batch.num_reqs,
                                windows, self._rows[2])

    def prepare(self, batch, bufs, writes_slots, R, num_tokens_padded):
        try:
            return self._prepare_loop(batch, bufs, writes_slots).prepare(
                R, -1 if num_tokens_padded is None else num_tokens_padded)
        except NATIVE.PlaceholderRead as e:
            raise placeholder_read_error(batch, bufs, e.args[0]) from None

    def write_drafts(self, batch, rows, lens, flat) -> None:
        if self._drafts is None or self._drafts[0] is not batch:
            self._drafts = (batch, NATIVE.DraftRows(batch.token_ids_cpu, batch.num_tokens, batch.num_spec_tokens))
        if rows is None:
            self._drafts[1].write(_NO_SEL, _NO_SEL, _NO_IDS)
        else:
            self._drafts[1].write(rows, lens, flat)

    def spec_layout(self, batch, bufs, R):
        op = self._spec
        if op is None or op[0] is not batch or op[1] is not bufs:
            op = self._spec = (batch, bufs, NATIVE.SpecLayout(
                batch.num_spec_tokens, bufs.query_start_loc.np, bufs.discard, bufs.input_ids.np,
                bufs.spec_logits_indices.np, bufs.spec_target.np, bufs.spec_bonus.np, bufs.spec_cu.np,
                bufs.spec_draft_ids.np))
        return op[2].layout(R)

    def _sampled_rows(self, batch):
        op = self._stage8
        if op is None or op[0] is not batch:
            op = self._stage8 = (batch, NATIVE.SampledRows(
                batch.token_ids_cpu, batch.num_tokens, batch.num_computed_tokens_cpu, batch.num_scheduled_tokens,
                batch.num_spec_tokens, batch.prev_sampled_index, batch.prev_sampled_pos, batch._req_ids))
        return op[1]

    def append_tokens(self, batch, rows, max_model_len, held, tokens):
        return self._sampled_rows(batch).append_tokens(rows, batch.num_reqs, max_model_len, held, tokens)

    def append_verified(self, batch, rows, max_model_len, token_ids):
        n = rows.shape[0]
        try:  # per row a token list (the numpy code words anything else)
            lens = np.fromiter(map(len, token_ids), np.int64, n)
        except (TypeError, ValueError):
            return False
        flat = np.empty(int(lens.sum()), np.int32)
        if self.pack_ints(token_ids if type(token_ids) is list else list(token_ids), flat)[0] != flat.shape[0]:
            return False  # (stage 8's typing rule is the packer's: append.token_id_array)
        return self._sampled_rows(batch).append_verified(rows, batch.num_reqs, max_model_len, np.empty(n, np.int64),
                                                         lens, flat)

    def append_placeholders(self, batch, rows, max_model_len, held):
        return self._sampled_rows(batch).append_placeholders(rows, batch.num_reqs, max_model_len, held)

    def fill_placeholders(self, batch, requests, placeholders, toks):
        p, op = placeholders, self._sampled_rows(batch)
        try:  # (the recorded rows while no request has left its row)
            return op.fill(p.req_ids, p.positions, p.rows if p.layout is batch.layout else None,
                           batch.req_id_to_index, requests, toks)
        except (TypeError, ValueError):  # a Placeholders made by hand, with other types: numpy decides
            return -1

    def prepare_patched(self, batch, bufs, writes_slots, R, num_tokens_padded, prev_token_ids, expected,
                        prev_host=-1):
        prep = self._prepare_loop(batch, bufs, writes_slots)
        P = -1 if num_tokens_padded is None else num_tokens_padded
        if prev_host >= 0:  # host_tokens' address of n int64 tokens
            n = batch.num_prev_sampled
        else:  # prev_tokens_tensor made a CPU tensor int64 with unit stride, or it is on the device
            t = prev_token_ids
            prev_host, n = 0, t.numel()
            if t.is_cpu:
                t.numpy()  # raises where numpy cannot read it (a zero tensor, the negative bit), as the numpy kernels
                prev_host = t.data_ptr()
        try:
            return prep.prepare_patched(R, P, prev_host if bufs.input_ids.aliased else 0, n, expected)
        except NATIVE.PlaceholderRead as e:
            raise placeholder_read_error(batch, bufs, e.args[0]) from None
        except ValueError as e:
            raise prev_token_error(str(e)) from None


_NO_SEL = np.zeros(0, np.int64)
_NO_STARTS = np.zeros((1, 0), np.int64)
_NO_IDS = np.zeros(0, np.int32)


def choose_kernels(native: bool | None, sampling_params_cls: type) -> StepKernels:
    """The compiled kernels when built and not refused (``native`` ``False``, or
    ``ATTNPLUG_NATIVE=0`` at import), else the numpy ones."""
    if NATIVE is not None and native is not False:
        return CompiledKernels(sampling_params_cls)
    return NumpyKernels()


def kernels_available() -> bool:
    """Whether the compiled kernels are built (and not disabled)."""
    return NATIVE is not None


__all__ = ["CompiledKernels", "NumpyKernels", "PrepareBuffers", "StepKernels", "choose_kernels",
           "kernels_available", "writes_host_tokens"]
