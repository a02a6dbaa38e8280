"""``StepCompiler``: scheduler deltas in, one step's flat inputs and metadata out.

It owns the runner's persistent request state — ``requests`` (object view,
:class:`CachedRequestState`) and ``input_batch`` (columnar view, :class:`InputBatch`) —
and nothing model-specific, so a model runner composes it:

.. code-block:: python

    sc.update_states(scheduler_output)             # validate, then apply the deltas
    inputs = sc.prepare_inputs(scheduler_output)   # tokens, positions, metadata per group
    hidden = model(inputs.input_ids, inputs.positions, ...)   # builders read
    #        inputs.common_attn_metadata[g] for cache group g
    keep = ~inputs.discard                         # partial prefills produce no token
    sc.append_output_tokens([inputs.req_ids[i] for i in np.flatnonzero(keep)], sampled)

The scheduler never re-sends the runner's own samples: ``append_output_tokens`` is how
they enter the token history. Everything ``prepare_inputs`` returns is a view of a
persistent buffer, valid until the next ``update_states``.

With ``ATTNPLUG_VALIDATE=1`` (read at construction) ``prepare_inputs`` checks the eight
invariants (``attnplug.core.validate``) for every cache group each step.
"""

from __future__ import annotations

import operator
import os
from typing import Sequence

import numpy as np
import torch

from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.cache_groups.specs import cdiv
from attnplug.core.devices import resolve_device
from attnplug.core.errors import InvalidSchedulerOutput, KVCacheSpecError, MetadataError
from attnplug.core.validation import BatchView, RowState, validate
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.prepare import InputPreparer, StepInputs, build_common_attn_metadata
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import SamplingParams, SchedulerOutput
from attnplug.runner.step.int_packer import IntPacker
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.check import apply_update, plan_update

_GROUP_KINDS = ("full_attention", "sliding_window", "mamba")


class StepCompiler:
    """Validates and applies scheduler outputs; prepares each step's inputs.

    Args:
        block_sizes: manager block size per cache group, or a :class:`KVCacheConfig`
            (then block sizes, ``num_blocks`` and group kinds come from it).
        max_num_reqs: most requests in one step (batch rows).
        max_model_len: most tokens a request may hold.
        max_num_batched_tokens: most tokens in one step.
        device: where device tensors live (``"cpu"``: host buffers are used directly).
        kernel_block_sizes: per group, the kernel block size (divides the manager size).
        reorder_batch_threshold: if set, rows with ``num_scheduled_tokens <= threshold``
            are moved before the others each step (decodes first).
        num_blocks: blocks per group's pool (valid ids ``[1, num_blocks)``); default: any
            id whose kernel expansion fits ``int32``.
        group_kinds: per group ``"full_attention"`` (default), ``"sliding_window"`` (the
            null block is legitimate in a request's initial or replacement block list) or
            ``"mamba"`` (one state block per request; no slot mapping).
        validate: run ``attnplug.core.validate`` every step; ``None`` reads
            ``ATTNPLUG_VALIDATE=1`` from the environment.
        sliding_windows: per group, the window ``W`` (tokens) of a ``"sliding_window"``
            group, ``None`` otherwise. Given a window, the compiler nulls the blocks no
            query can see in the group's block table each step, as the block pool frees
            them (``runner.step.apply_windows``); without one it keeps whatever ids the
            scheduler sent. Default: from the specs of a :class:`KVCacheConfig`, else none.
        native: use the compiled fast paths (``runner.step.fast``) when they are built;
            ``None`` (default) uses them unless ``ATTNPLUG_NATIVE=0``. Results are the
            same either way; ``False`` runs the numpy paths only.

    Attributes:
        requests: ``{req_id: CachedRequestState}``, every request the runner holds
            (scheduled or not).
        input_batch: the rows of the current step.

    Raises:
        KVCacheSpecError: inconsistent group configuration.
    """

    def __init__(self, block_sizes: Sequence[int] | KVCacheConfig, max_num_reqs: int, max_model_len: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu",
                 kernel_block_sizes: Sequence[int] | None = None,
                 reorder_batch_threshold: int | None = None, *, num_blocks: int | None = None,
                 group_kinds: Sequence[str] | None = None, validate: bool | None = None,
                 sliding_windows: Sequence[int | None] | None = None, native: bool | None = None):
        if isinstance(block_sizes, KVCacheConfig):
            cfg = block_sizes
            block_sizes = cfg.block_sizes
            if num_blocks is None:
                num_blocks = [cfg.num_blocks_of(g) for g in range(len(cfg.groups))]
            group_kinds = [g.kv_cache_spec.kind for g in cfg.groups] if group_kinds is None else group_kinds
            if sliding_windows is None:
                sliding_windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in cfg.groups]
        self.block_sizes = [int(b) for b in block_sizes]
        self.num_groups = len(self.block_sizes)
        self.kernel_block_sizes = list(self.block_sizes if kernel_block_sizes is None else kernel_block_sizes)
        self.group_kinds = list(group_kinds or ["full_attention"] * self.num_groups)
        if len(self.group_kinds) != self.num_groups or any(k not in _GROUP_KINDS for k in self.group_kinds):
            raise KVCacheSpecError(f"group_kinds {self.group_kinds!r}: need one of {_GROUP_KINDS} per group")
        self.null_block_allowed = [k == "sliding_window" for k in self.group_kinds]
        self.sliding_windows = list(sliding_windows or [None] * self.num_groups)
        if len(self.sliding_windows) != self.num_groups or any(
                w is not None and (k != "sliding_window" or isinstance(w, bool) or not isinstance(w, int) or w <= 0)
                for w, k in zip(self.sliding_windows, self.group_kinds)):
            raise KVCacheSpecError(f"sliding_windows {self.sliding_windows!r}: need one entry per group, a positive "
                                   "int only for 'sliding_window' groups and None for the others")
        self.has_sliding_windows = any(w is not None for w in self.sliding_windows)
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.reorder_batch_threshold = reorder_batch_threshold
        self.device = resolve_device(device)
        use_native = NATIVE is not None and native is not False
        self.input_batch = InputBatch(max_num_reqs, max_model_len, max_num_batched_tokens, self.block_sizes,
                                      self.device, self.kernel_block_sizes, use_native)
        kmax = max(b // k for b, k in zip(self.block_sizes, self.kernel_block_sizes))
        if num_blocks is None:
            num_blocks = (2**31 - 1) // kmax
        per_group = [int(n) for n in num_blocks] if isinstance(num_blocks, (list, tuple)) else \
            [int(num_blocks)] * self.num_groups
        if len(per_group) != self.num_groups or min(per_group) < 2:
            raise KVCacheSpecError(f"num_blocks must be >= 2 (block 0 is the null block) per group, got {num_blocks}")
        self.num_blocks_per_group = per_group
        """Valid block ids of group g are ``[1, num_blocks_per_group[g])`` (Mamba groups: state slots)."""
        self.num_blocks = min(per_group)
        """The smallest pool: ids below it are valid in every group (the fast path's check)."""
        self.max_num_blocks_per_req = [cdiv(max_model_len, b) for b in self.block_sizes]
        self._max_blocks_col = np.asarray(self.max_num_blocks_per_req, dtype=np.int64)[:, None]
        # tokens one block covers, per group, for the "block table too short" check; a Mamba
        # group's single state block covers any length.
        self._capacity_col = np.asarray([max_model_len if k == "mamba" else b for b, k in
                                         zip(self.block_sizes, self.group_kinds)], dtype=np.int64)[:, None]
        self.requests: dict[str, CachedRequestState] = {}
        self.native = use_native
        """Whether the compiled fast paths run (``runner.step.fast``)."""
        self._preparer = InputPreparer(max_num_reqs, max_model_len, max_num_batched_tokens, self.device,
                                       native=use_native)
        self._prompt_packer = IntPacker(native=use_native)
        self._block_packer = IntPacker(1 << 12, native=use_native)
        self._delta_packer = IntPacker(1 << 10, native=use_native)
        self._cached_scan = self._new_scan = None
        if use_native:
            b = self.input_batch
            tables = list(b.block_table)
            self._cached_scan = NATIVE.CachedScan(
                b.num_tokens, b.num_computed_tokens_nulled, b.num_computed_tokens_cpu, b.num_scheduled_tokens,
                b.block_table.num_blocks_per_row, [bt.block_table_np for bt in tables],
                [bt.kernel_block_table.np for bt in tables], [bt.kernel_blocks_per_block for bt in tables],
                self._capacity_col[:, 0], self.num_blocks_per_group, self.null_block_allowed)
            self._new_scan = NATIVE.NewScan(
                b.token_ids_cpu, b.num_tokens, b.num_prompt_tokens, b.num_computed_tokens_cpu, b.num_scheduled_tokens,
                b.num_computed_tokens_nulled, b.temperature, b.top_k, b.top_p, b.block_table.num_blocks_per_row,
                [bt.block_table_np for bt in tables], [bt.kernel_block_table.np for bt in tables],
                [bt.kernel_blocks_per_block for bt in tables],
                [0 if k == "mamba" else bs for bs, k in zip(self.block_sizes, self.group_kinds)],
                self.num_blocks_per_group, SamplingParams)
        self.validate = os.environ.get("ATTNPLUG_VALIDATE") == "1" if validate is None else bool(validate)

    # --- the step -----------------------------------------------------------------------
    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Validate ``scheduler_output`` in full, then apply it (see ``runner.step.check``).

        Raises:
            InvalidSchedulerOutput: unknown or duplicate request ids, a new request that is
                already resident, negative or oversized counts, inconsistent
                ``num_computed_tokens``, block ids outside the pool (or null where it is not
                legitimate), more tokens than ``max_num_batched_tokens`` or
                ``max_model_len``, a block table too short for ``seq_lens``, unknown
                finished ids. The state is then exactly as before the call.
        """
        apply_update(self, plan_update(self, scheduler_output))

    def prepare_inputs(self, scheduler_output: SchedulerOutput | None = None,
                       num_tokens_padded: int | None = None, *, build_metadata: bool = True) -> StepInputs:
        """The step's inputs for the rows ``update_states`` left (see ``runner.step.prepare``).

        Args:
            scheduler_output: the output just applied (checked for the token count only).
            num_tokens_padded: pad the token dimension to this many (``>= num_actual_tokens``,
                ``<= max_num_batched_tokens``).
            build_metadata: also build ``common_attn_metadata`` (one per group).

        Returns:
            :class:`StepInputs`; its tensors are views valid until the next ``update_states``.
            On CUDA the device tensors are filled by non-blocking copies out of pinned host
            buffers that the next step rewrites: a caller must let those copies run before
            its next ``update_states`` (``ModelRunner`` waits on a ``HostBufferFence``).

        Raises:
            InvalidSchedulerOutput: ``scheduler_output`` is not the one just applied.
            MetadataError: a bad ``num_tokens_padded``.
            MetadataInvariantError: with validation on, a broken invariant.
        """
        b = self.input_batch
        if num_tokens_padded is not None:
            try:
                num_tokens_padded = operator.index(num_tokens_padded)
            except TypeError:
                raise MetadataError(f"num_tokens_padded must be an int, got {num_tokens_padded!r}") from None
        if self.native and (num_tokens_padded is None or 0 <= num_tokens_padded <= self.max_num_batched_tokens):
            # the compiled loop counts the tokens as it goes: check its count afterwards
            # (it writes only the step's output buffers, no request state)
            inputs = self._preparer.prepare(b, self.group_kinds, num_tokens_padded)
            self._check_step_size(scheduler_output, inputs.num_actual_tokens, num_tokens_padded)
        else:
            self._check_step_size(scheduler_output, int(b.num_scheduled_tokens[:b.num_reqs].sum()),
                                  num_tokens_padded)
            inputs = self._preparer.prepare(b, self.group_kinds, num_tokens_padded)
        if build_metadata or self.validate:
            self.build_common_attn_metadata(inputs)
        if self.validate:
            self.check(inputs)
        return inputs

    def _check_step_size(self, scheduler_output: SchedulerOutput | None, Q: int, num_tokens_padded: int | None):
        if scheduler_output is not None and scheduler_output.total_num_scheduled_tokens != Q:
            raise InvalidSchedulerOutput(None, "total_num_scheduled_tokens", (
                f"is {scheduler_output.total_num_scheduled_tokens} but the batch holds {Q} scheduled "
                "tokens: call update_states with this output first"))
        if num_tokens_padded is not None and not Q <= num_tokens_padded <= self.max_num_batched_tokens:
            raise MetadataError(f"num_tokens_padded={num_tokens_padded} must lie in [{Q}, "
                                f"{self.max_num_batched_tokens}] (num_actual_tokens .. max_num_batched_tokens)")

    def build_common_attn_metadata(self, inputs: StepInputs):
        """Build (and store in ``inputs``) the per-group :class:`CommonAttentionMetadata`."""
        return build_common_attn_metadata(
            inputs, self.input_batch.num_computed_tokens_cpu_view(inputs.num_reqs))

    def check(self, inputs: StepInputs) -> None:
        """Run ``attnplug.core.validate`` on every group's metadata of ``inputs``.

        Raises:
            MetadataInvariantError: the first broken invariant.
        """
        view = self.batch_view()
        for g, cm in enumerate(inputs.common_attn_metadata):
            bs = None if self.group_kinds[g] == "mamba" else self.kernel_block_sizes[g]
            validate(cm, block_size=bs, num_scheduled_tokens=inputs.num_scheduled_tokens,
                     num_tokens=inputs.num_tokens, discard=inputs.discard, batch=view,
                     sliding_window=self.sliding_windows[g], manager_block_size=self.block_sizes[g])

    def append_output_tokens(self, req_ids_or_rows, token_ids) -> None:
        """Append sampled tokens to requests of this step (both views: the row is the state).

        Args:
            req_ids_or_rows: request ids, or batch rows (ints), of this step; distinct.
            token_ids: one token per request (``[n]`` ints), or per request a list of tokens.

        Raises:
            MetadataError: an id not in the batch, a repeated request, a row whose logits are
                discarded this step (partial prefill, or tokens already appended), a bad
                token id, or more tokens than ``max_model_len`` (nothing changes).
        """
        b = self.input_batch
        n = len(req_ids_or_rows)
        if n == 0:
            return
        if isinstance(req_ids_or_rows[0], str):
            try:
                rows = np.fromiter(map(b.req_id_to_index.__getitem__, req_ids_or_rows), np.int64, n)
            except KeyError as e:
                raise MetadataError(f"append_output_tokens: request {e.args[0]!r} is not in this step's "
                                    "batch; only scheduled requests can receive tokens") from None
        else:
            rows = np.asarray(req_ids_or_rows, dtype=np.int64).reshape(n)
            if rows.min() < 0 or rows.max() >= b.num_reqs:
                raise MetadataError(f"append_output_tokens: rows must lie in [0, {b.num_reqs}), got {rows.tolist()}")
        if len(token_ids) != n:
            raise MetadataError(f"append_output_tokens: {len(token_ids)} token entries for {n} requests")
        ragged = n and isinstance(token_ids[0], (list, tuple, np.ndarray))
        lens = (np.fromiter(map(len, token_ids), np.int64, n) if ragged else np.ones(n, np.int64))
        try:
            flat = np.asarray([t for ts in token_ids for t in ts] if ragged else token_ids, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise MetadataError(f"append_output_tokens: token ids must be ints, got {token_ids!r}") from None
        if flat.shape != (int(lens.sum()),) or (flat.shape[0] and (flat.min() < 0 or flat.max() >= 2**31)):
            raise MetadataError(f"append_output_tokens: token ids must be ints in [0, 2**31), got {token_ids!r}")
        seen = np.zeros(b.max_num_reqs, dtype=bool)
        seen[rows] = True
        if np.count_nonzero(seen) != n:
            raise MetadataError("append_output_tokens: a request appears twice; pass each request once "
                                "with all its tokens")
        held = b.num_tokens[rows].astype(np.int64)
        seq = b.num_computed_tokens_cpu[rows].astype(np.int64) + b.num_scheduled_tokens[rows]
        if (seq != held).any():
            i = int(np.argmax(seq != held))
            raise MetadataError(
                f"append_output_tokens: request {b._req_ids[rows[i]]!r} has seq_len {int(seq[i])} < "
                f"num_tokens {int(held[i])}: its logits are discarded this step (partial prefill or "
                "recompute), or its token was already appended; append only to rows with discard False")
        if (held + lens > self.max_model_len).any():
            i = int(np.argmax(held + lens > self.max_model_len))
            raise MetadataError(f"append_output_tokens: request {b._req_ids[rows[i]]!r} would hold "
                                f"{int(held[i] + lens[i])} tokens > max_model_len {self.max_model_len}")
        if not ragged or (lens == 1).all():
            b.token_ids_cpu[rows, held] = flat
        else:
            off = 0
            for r, h, k in zip(rows.tolist(), held.tolist(), lens.tolist()):
                b.token_ids_cpu[r, h:h + k] = flat[off:off + k]
                off += k
        b.num_tokens[rows] = held + lens

    # --- views for checks and tests -----------------------------------------------------
    def batch_view(self) -> BatchView:
        """The columnar view for ``attnplug.core.validate`` (rows and object view). Debug use."""
        b = self.input_batch
        R = b.num_reqs
        states = {}
        for rid in b._req_ids[:R]:
            st = self.requests.get(rid) if rid is not None else None
            if st is not None:
                tokens = list(st.prompt_token_ids) + list(st.output_token_ids)
                states[rid] = RowState(rid, tokens, st.num_computed_tokens, st.block_ids)
        return BatchView(
            req_ids=list(b._req_ids[:R]), req_id_to_index=dict(b.req_id_to_index),
            token_ids=b.token_ids_cpu, num_tokens=b.num_tokens,
            num_computed_tokens=b.num_computed_tokens_cpu,
            block_ids=[bt.block_table_np for bt in b.block_table],
            num_blocks=[bt.num_blocks_per_row for bt in b.block_table], states=states)

    def snapshot(self) -> dict:
        """A deep copy of every piece of state (both views), for before/after comparisons
        in tests. Not for the hot path: it copies the whole token table."""
        b = self.input_batch
        snap = {
            "token_ids": b.token_ids_cpu.copy(),
            "columns": [c.copy() for c in b.row_columns],
            "req_ids": list(b._req_ids),
            "states_by_row": [None if s is None else id(s) for s in b._states],
            "req_id_to_index": dict(b.req_id_to_index),
            "holes": sorted(b._holes),
            "num_rows": b._num_rows,
            "generators": {r: id(g) for r, g in b.generators.items()},
            "block_tables": [(bt.block_table_np.copy(), bt.kernel_block_table.np.copy(),
                              bt.num_blocks_per_row.copy()) for bt in b.block_table],
            "requests": {rid: (id(st), st.row, st.all_token_ids, st.num_computed_tokens, st.block_ids,
                               st.sampling_params, id(st.generator))
                         for rid, st in self.requests.items()},
        }
        return snap


def snapshot_diff(a, b, path: str = "state") -> list[str]:
    """Where two :meth:`StepCompiler.snapshot` results differ (paths like
    ``state['columns'][2]``); empty when they are identical (arrays: same dtype and values)."""
    if isinstance(a, np.ndarray):
        same = isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [path]
        return [d for k in a for d in snapshot_diff(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in snapshot_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]
