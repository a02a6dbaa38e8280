"""``FlashAttnMetadataBuilder``: lowers each step into FlashAttention's arguments.

``cu_seqlens_q`` is ``query_start_loc``; ``seqused_k`` is ``seq_lens`` (and FA2's
``cu_seqlens_k`` its exclusive prefix sum); ``max_seqlen_q/k`` are the step's bounds;
the block table is the group's int32 kernel block table; the window is ``(W - 1, 0)``.
With FlashAttention 3 the builder also runs ``get_scheduler_metadata`` for the step's
shapes, and with ``common_prefix_len > 0`` it emits the cascade fields.

An eager ``build`` passes the step's tensors through: ``prepare_inputs`` returns views of
persistent buffers at the same addresses every step (``runner/step/prepare.py``), so the
only device work is FA2's ``cu_seqlens_k`` (one cumsum into a persistent buffer) and
FA3's scheduler metadata. ``build_for_cudagraph_capture`` copies the tensors into
persistent buffers allocated once from the :class:`BuilderConfig` (the block table's
live columns only), so a captured graph replays with the next step's contents whatever
the caller passes. Host values are checked only with ``ATTNPLUG_VALIDATE=1``
(``backends/common/buffer_checks.py``). An eager build with the same tensor objects and
``num_reqs`` as the last checked one compares a handful of host ints against that pass
instead of checking again, and fills its metadata from the last one's (``_passed``).
"""

from __future__ import annotations

import dataclasses

import torch

from attnplug.backends.common.buffer_checks import (
    NOT_PASSED,
    StepTensorChecks,
    builder_values_checked,
    check_step_tensors,
    check_step_values,
    copy_block_table,
)
from attnplug.backends.common.frozen_fields import frozen_factory, replace_fields, tables_replacer, template_factory
from attnplug.backends.common.window import fa_window_size
from attnplug.backends.flash_attn.cascade import cascade_fields, cascade_for
from attnplug.backends.flash_attn.kernels import (
    FA2_PAGE_SIZE_MULTIPLE,
    LIVE_LAYER_PARAMS,
    FlashAttnKernels,
    installed_kernels,
)
from attnplug.backends.flash_attn.metadata import FlashAttnMetadata
from attnplug.cache_groups.specs import cdiv
from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder, BuilderConfig
from attnplug.core.errors import BackendUnsupportedError, MetadataError
from attnplug.core.metadata import CommonAttentionMetadata


_new_metadata = frozen_factory(FlashAttnMetadata)
"""``FlashAttnMetadata(...)`` with every field, without the frozen ``__init__``'s cost."""
_from_last = template_factory(FlashAttnMetadata, "num_actual_tokens", "max_query_len", "max_seq_len", "causal",
                              "cu_seqlens_k")
"""The metadata of an eager build the last pass covers: its instance dict with the per-step fields."""
_with_tables = tables_replacer(FlashAttnMetadata, "block_table", "slot_mapping", "cascade")
"""``replace(md, block_table=..., slot_mapping=..., cascade=...)``, generated for the three fields."""
_with_scheduler = tables_replacer(FlashAttnMetadata, "scheduler_metadata")
"""``replace(md, scheduler_metadata=...)``."""


class FlashAttnMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`FlashAttnMetadata` into persistent buffers (see the module docstring).

    ``FlashAttnMetadataBuilder(kv_cache_spec, layer_names, config, device)``: the kernel
    block size is ``kv_cache_spec.block_size``; a ``sliding_window`` on the spec sets the
    window. Buffers hold ``config.max_num_reqs`` requests (padded ones included),
    ``config.max_num_batched_tokens`` tokens and ``cdiv(config.max_model_len,
    block_size)`` blocks per request.

    Raises:
        MetadataError: non-positive limits, or (under FlashAttention 2) a block size that
            is not a multiple of 256.
    """

    cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold = None
    supports_update_block_table = True
    supports_cascade = True  # full attention only: cascade_for returns None with a sliding window

    @classmethod
    def load_kernels(cls) -> FlashAttnKernels:
        """The kernels this builder plans for (installed flash-attn; emulators override).

        Raises:
            BackendUnsupportedError: flash-attn is not installed.
        """
        kernels = installed_kernels()
        if kernels is None:
            from attnplug.backends.flash_attn.kernels import unavailable_reason
            raise BackendUnsupportedError("flash_attn", [unavailable_reason() or "flash-attn unavailable"],
                                          context="FlashAttnMetadataBuilder")
        return kernels

    @classmethod
    def kernels_version(cls) -> int:
        """2 or 3; 2 (the default declaration) when nothing is installed."""
        kernels = installed_kernels()
        return 2 if kernels is None else kernels.version

    @classmethod
    def get_cudagraph_support(cls, kv_cache_spec=None) -> AttentionCGSupport:
        """``ALWAYS`` under FlashAttention 3 (scheduler metadata in a persistent buffer);
        ``UNIFORM_BATCH`` under FA2, whose kernel choice depends on host-side lengths."""
        return AttentionCGSupport.ALWAYS if cls.kernels_version() == 3 else AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names: list[str], config: BuilderConfig,
                 device: torch.device | str):
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.block_size = int(kv_cache_spec.block_size)
        self.sliding_window = getattr(kv_cache_spec, "sliding_window", None)
        self.window_size = fa_window_size(self.sliding_window)
        if min(config.max_num_reqs, config.max_num_batched_tokens, config.max_model_len) <= 0:
            raise MetadataError(f"FlashAttnMetadataBuilder: BuilderConfig limits must be positive, got {config}")
        if self.kernels_version() == 2 and self.block_size % FA2_PAGE_SIZE_MULTIPLE:
            raise MetadataError(
                f"FlashAttnMetadataBuilder got block_size {self.block_size}: FlashAttention 2 pages K/V in "
                f"multiples of {FA2_PAGE_SIZE_MULTIPLE} tokens; use a manager block size that is a multiple of "
                f"{FA2_PAGE_SIZE_MULTIPLE}, install FlashAttention 3, or pick another backend")
        dev = self.device
        self.max_num_blocks_per_req = cdiv(config.max_model_len, self.block_size)
        n = config.max_num_reqs
        self._query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self._cu_seqlens_k = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self._block_table = torch.full((n, self.max_num_blocks_per_req), NULL_BLOCK_ID, dtype=torch.int32,
                                       device=dev)
        self._slot_mapping = torch.full((config.max_num_batched_tokens,), PAD_SLOT_ID, dtype=torch.int64,
                                        device=dev)
        # FA3's get_scheduler_metadata returns 1 + k * round_up(batch, 4) int32 (k <= 4 in
        # the versions we know; the exact length varies): room for the largest, so that graph
        # replays find it in the same place
        self._scheduler_metadata = torch.zeros(1 + 4 * cdiv(n, 4) * 4 + 64, dtype=torch.int32, device=dev)
        self._version = self.kernels_version()
        self.validate_values = builder_values_checked()
        """Check the host values of every step (``ATTNPLUG_VALIDATE=1`` when created)."""
        self._step_checks = StepTensorChecks(
            device=dev, block_size=self.block_size, max_num_blocks_per_req=self.max_num_blocks_per_req,
            max_model_len=config.max_model_len, slot_capacity=config.max_num_batched_tokens, backend="flash_attn")
        self._passed: tuple = NOT_PASSED + (None, None)
        """The last checked eager build's structural pass (``StepTensorChecks.pass_step``, for
        ``B`` rows), its ``num_reqs`` and its metadata's instance dict (no cascade, no
        scheduler metadata): a build whose four tensors and ``num_reqs`` are the same and
        whose host ints fit the pass's bounds skips the checks, and its metadata is that
        dict with the per-step fields set (``_from_last``). Never set with
        ``validate_values`` (every build is then checked in full)."""
        self._tables_passed: tuple = NOT_PASSED[:5]
        """``StepTensorChecks.pass_tables`` of the last ``update_block_table``."""
        self._plan_version, self._plan = -1, None
        """``LIVE_LAYER_PARAMS.version`` when :meth:`_scheduler_plan` last looked, and its answer."""

    # --- build ---------------------------------------------------------------------------
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashAttnMetadata:
        """Lower the step's metadata (never mutates it).

        Args:
            common_prefix_len: tokens every request shares at the start of its KV (cascade
                attention). It is rounded down to whole blocks and to the smallest
                ``num_computed_tokens``; cascade is off with a sliding window. Precondition:
                the requests' block tables really share those first blocks.
            common_attn_metadata: the step's metadata for this group (kernel block table);
                may be padded (``query_start_loc`` longer than ``num_reqs + 1``).
            fast_build: skip FA3 scheduler metadata.

        Returns:
            The metadata every layer of the group passes to ``forward``.

        Raises:
            MetadataError: sizes that disagree or exceed the buffers (nothing is copied).

        Reads host ints and ``_cpu`` tensors; the device work is copies and one cumsum.
        """
        cm = common_attn_metadata
        qsl, seq_lens, block_table, slot_mapping = (cm.query_start_loc, cm.seq_lens, cm.block_table_tensor,
                                                    cm.slot_mapping)
        n, num_actual_tokens, max_query_len, max_seq_len = (cm.num_reqs, cm.num_actual_tokens, cm.max_query_len,
                                                            cm.max_seq_len)
        p_qsl, p_seq_lens, p_bt, p_sm, _, p_tokens, p_seq_len, p_n, template = self._passed
        if not (p_qsl is qsl and p_seq_lens is seq_lens and p_bt is block_table and p_sm is slot_mapping
                and p_n == n and num_actual_tokens <= p_tokens and max_seq_len <= p_seq_len
                and common_prefix_len <= 0):
            return self._build(cm, common_prefix_len, max_query_len, max_seq_len, fast_build)
        md = _from_last(template, num_actual_tokens, max_query_len, max_seq_len, cm.causal,
                        None if self._version != 2 else self._cu_seqlens_k_of(template["seq_lens"], False))
        if fast_build or self._version != 3:
            return md
        sched = self._scheduler_metadata_for(md)
        return md if sched is None else _with_scheduler(md, sched)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlashAttnMetadata:
        """Metadata for a CUDA-graph step (capture, and the replays of the same padded shape).

        The host ints a graph bakes in are replaced by bounds that hold for every replay:
        ``max_seqlen_k = max_model_len`` and ``max_seqlen_q = 1`` for single-token batches,
        else the padded token count. No cascade.
        """
        cm = common_attn_metadata
        max_q = 1 if cm.max_query_len <= 1 else int(cm.slot_mapping.shape[0])
        return self._build(cm, 0, max_q, self.config.max_model_len, False, graph=True)

    def _build(self, cm: CommonAttentionMetadata, common_prefix_len: int, max_query_len: int,
               max_seq_len: int, fast_build: bool, graph: bool = False) -> FlashAttnMetadata:
        B = self._check(cm, graph)
        if graph:
            qsl = self._query_start_loc[: B + 1]
            qsl.copy_(cm.query_start_loc, non_blocking=True)
            seq_lens = self._seq_lens[:B]
            seq_lens.copy_(cm.seq_lens[:B], non_blocking=True)
            block_table = copy_block_table(self._block_table, cm.block_table_tensor, B,
                                           cdiv(cm.max_seq_len, self.block_size))
            slot_mapping = self._copy_slot_mapping(cm.slot_mapping)
        else:
            qsl, seq_lens, block_table = cm.query_start_loc, cm.seq_lens, cm.block_table_tensor
            if seq_lens.shape[0] != B:
                seq_lens = seq_lens[:B]
            if block_table.shape[0] != B:
                block_table = block_table[:B]
            slot_mapping = cm.slot_mapping
        md = _new_metadata(
            cm.num_reqs, cm.num_actual_tokens, int(max_query_len), int(max_seq_len),
            self.block_size, cm.causal, qsl, seq_lens, self._cu_seqlens_k_of(seq_lens, graph), block_table, slot_mapping,
            self.window_size, None, None, graph)
        if not graph and not self.validate_values:
            self._passed = self._passed[:7] + (cm.num_reqs, dict(md.__dict__))  # (pass_step in _check)
        cascade = (cascade_for(md, cm, common_prefix_len, self.sliding_window, self.device) if common_prefix_len > 0
                   else None)
        sched = None if (fast_build or cascade is not None) else self._scheduler_metadata_for(md, graph)
        if cascade is None and sched is None:
            return md
        return replace_fields(md, cascade=cascade, scheduler_metadata=sched)

    def _cu_seqlens_k_of(self, seq_lens: torch.Tensor, graph: bool) -> torch.Tensor | None:
        """FA2's ``cu_seqlens_k``: in the persistent buffer for a CUDA-graph build (replays
        read it), a new tensor for an eager one (re-entrancy: a later build must not
        overwrite it before this metadata runs); ``None`` under FA3 (unused there)."""
        if self._version != 2:
            return None
        n = seq_lens.shape[0] + 1
        cu_k = self._cu_seqlens_k[:n] if graph else torch.zeros(n, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=cu_k[1:])
        return cu_k

    def update_block_table(self, metadata: FlashAttnMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> FlashAttnMetadata:
        """A copy of ``metadata`` (built by a builder of this class for a group with the same
        spec) reading ``block_table`` and writing ``slot_mapping``.

        An eager ``metadata`` gets the two tensors as given (its other tensors are shared);
        a CUDA-graph one (``metadata.graph``) gets every tensor copied into this builder's
        persistent buffers (the whole block table: a graph build's ``max_seq_len`` is the
        bound ``max_model_len``).

        Args:
            metadata: the other group's metadata; not mutated.
            block_table: ``[>= B, max_num_blocks_per_req]``, ``torch.int32``, device.
            slot_mapping: ``[num_tokens]``, ``torch.int64``, device.

        Raises:
            MetadataError: a block table or slot mapping that does not fit ``metadata``
                (nothing is copied then).

        Does not synchronise with the host; graph-safe.
        """
        B = metadata.batch_size
        p_bt, p_sm, p_rows, p_tokens, p_seq_len = self._tables_passed
        if (p_bt is not block_table or p_sm is not slot_mapping or B > p_rows
                or metadata.num_actual_tokens > p_tokens or metadata.max_seq_len > p_seq_len):
            p_bt, p_sm, p_rows, p_tokens, p_seq_len = self._tables_passed = self._step_checks.pass_tables(
                block_table, slot_mapping, B, metadata.num_actual_tokens, metadata.max_seq_len)
        if metadata.block_size != self.block_size:
            raise MetadataError(f"update_block_table: metadata has block_size {metadata.block_size}, this builder "
                                f"{self.block_size}: only groups with the same spec may share a build")
        if not metadata.graph:
            md = _with_tables(metadata, block_table if p_rows == B else block_table[:B], slot_mapping, None)
        else:
            own = {}
            for name, buf, n in (("query_start_loc", self._query_start_loc, B + 1),
                                 ("seq_lens", self._seq_lens, B), ("cu_seqlens_k", self._cu_seqlens_k, B + 1)):
                src = getattr(metadata, name)
                if src is None:
                    continue
                view = buf[:n]
                if view.data_ptr() != src.data_ptr():
                    view.copy_(src, non_blocking=True)
                own[name] = view
            sched = metadata.scheduler_metadata
            if sched is not None:
                sched = self._keep_scheduler_metadata(sched, graph=True)
            # a graph build's max_seq_len is the bound max_model_len: every column may be live
            width = min(block_table.shape[1], self.max_num_blocks_per_req)
            md = dataclasses.replace(metadata, block_table=copy_block_table(self._block_table, block_table, B, width),
                                     slot_mapping=self._copy_slot_mapping(slot_mapping), scheduler_metadata=sched,
                                     cascade=None, **own)
        if metadata.cascade is not None:
            md = dataclasses.replace(md, cascade=cascade_fields(md, metadata.cascade.common_prefix_len, self.device))
        return md

    # --- FA3 scheduling --------------------------------------------------------------------
    def _scheduler_metadata_for(self, md: FlashAttnMetadata, graph: bool = False) -> torch.Tensor | None:
        """FA3 ``get_scheduler_metadata`` for one step, in a persistent buffer when it fits.

        Only when the group's layers agree on (query heads, soft-cap on/off): the call plans
        one kernel configuration. Otherwise ``None`` (the kernel schedules by itself).
        """
        if self._version != 3:
            return None
        plan = self._scheduler_plan()
        if plan is None:
            return None
        kernels = self.load_kernels()
        if kernels.get_scheduler_metadata is None:
            return None
        num_heads, has_softcap = plan
        # flash_attn_with_kvcache takes no max_seqlen_k: FA3 derives seqlen_k from the page
        # table's width, and the plan must be made for the seqlen_k the kernel will use (it
        # decides causal vs local, the splits and the metadata's length)
        sched = kernels.get_scheduler_metadata(
            batch_size=md.batch_size, max_seqlen_q=md.max_query_len,
            max_seqlen_k=int(md.block_table.shape[1]) * self.block_size,
            num_heads_q=num_heads, num_heads_kv=int(self.kv_cache_spec.num_kv_heads),
            headdim=int(self.kv_cache_spec.head_size), cache_seqlens=md.seq_lens,
            qkv_dtype=self.kv_cache_spec.dtype, cu_seqlens_q=md.query_start_loc, page_size=self.block_size,
            causal=md.causal, window_size=md.window_size, has_softcap=has_softcap)
        return self._keep_scheduler_metadata(sched, graph)

    def _scheduler_plan(self) -> tuple | None:
        """``(num_heads, has_softcap)`` when the group's live layers agree on one (query
        heads, soft-cap on/off), else ``None``; looked up again only when an impl was added
        or dropped (``LIVE_LAYER_PARAMS.version``)."""
        version = LIVE_LAYER_PARAMS.version
        if version != self._plan_version:
            layers = {(p.num_heads, p.logits_soft_cap is not None)
                      for p in LIVE_LAYER_PARAMS.for_spec(self.kv_cache_spec)}
            self._plan_version, self._plan = version, (next(iter(layers)) if len(layers) == 1 else None)
        return self._plan

    def _keep_scheduler_metadata(self, sched: torch.Tensor, graph: bool = False) -> torch.Tensor:
        """``sched`` itself for an eager build (metadata stays valid after later builds:
        re-entrant), a view of the persistent buffer for a graph build (fixed address)."""
        if not graph:
            return sched
        n = sched.shape[0]
        if n > self._scheduler_metadata.shape[0]:
            raise MetadataError(  # a captured graph would keep reading a freed, stale tensor
                f"FA3 scheduler metadata has {n} entries, more than the persistent buffer's "
                f"{self._scheduler_metadata.shape[0]}: this flash-attn version cannot be used with CUDA graphs "
                "by this builder; run without graphs or report the version")
        view = self._scheduler_metadata[:n]
        if view.data_ptr() != sched.data_ptr():
            view.copy_(sched, non_blocking=True)
            self._scheduler_metadata[n:].zero_()
        return view

    # --- copies into the persistent buffers (after validation) ---------------------------
    def _copy_slot_mapping(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        view = self._slot_mapping[: slot_mapping.shape[0]]
        view.copy_(slot_mapping, non_blocking=True)
        return view

    # --- validation (raises before anything is copied) ----------------------------------
    def _check(self, cm: CommonAttentionMetadata, graph: bool) -> int:
        """Raise before anything is copied; returns ``B`` (rows of ``query_start_loc`` - 1).
        An eager build's structural checks run in full and their pass is kept (``_passed``)."""
        n, cap = cm.num_reqs, self.config.max_num_reqs
        B = cm.query_start_loc.shape[0] - 1
        if not n <= B <= cap:
            raise MetadataError(
                f"query_start_loc has {B + 1} entries for num_reqs={n}: need num_reqs + 1 <= entries <= "
                f"BuilderConfig.max_num_reqs + 1 = {cap + 1} (padded requests included); raise max_num_reqs or "
                "pass query_start_loc[:num_reqs + 1].")
        if self.validate_values:
            check_step_tensors(cm, B, self.device, "flash_attn")
            check_step_values(cm, self.config.max_model_len)
        if graph or self.validate_values:
            self._step_checks.check(cm, B)
        else:
            self._passed = self._step_checks.pass_step(cm, B) + (None, None)  # (_build adds the template)
        return B
