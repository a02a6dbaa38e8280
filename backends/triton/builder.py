"""``TritonMetadataBuilder``: lowers each step for the Triton kernels without copying it.

The Triton kernels read the step's tensors as the step compiler made them: int32
``query_start_loc`` and ``seq_lens``, the group's int32 kernel block table and int64 slot
mapping. ``prepare_inputs`` returns those as views of its persistent buffers, at the same
addresses every step (``runner/step/prepare.py``, ``cache_groups/block_table.py``), so an
eager ``build`` passes them through (as vLLM's Triton builder does): a build is host-int
arithmetic (the split-KV decision) and a few structural checks, never a device copy and
never a host synchronisation. A build with the same tensor objects and row count as the
last checked one compares a handful of host ints against that pass instead of checking
again, and fills its metadata from the last one's (``_passed``). The host values are checked only with
``ATTNPLUG_VALIDATE=1`` (``backends/common/buffer_checks.py``).

``build_for_cudagraph_capture`` (capture and replays) copies into persistent buffers of
the builder, allocated once from the :class:`BuilderConfig` (the block table's live
columns only), so a captured graph reads fixed addresses whatever the caller passes:
``cudagraph_support = ALWAYS``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from attnplug.backends.common.buffer_checks import (
    NOT_PASSED,
    StepTensorChecks,
    builder_values_checked,
    check_step_tensors,
    check_step_values,
    copy_block_table,
)
from attnplug.backends.common.sealed import sealed_factory, sealed_replacer
from attnplug.backends.triton.cascade import cascade_fields, with_cascade
from attnplug.backends.triton.constants import KERNEL_BLOCK_SIZES
from attnplug.backends.triton.metadata import SplitKVPolicy, TritonAttentionMetadata
from attnplug.cache_groups.specs import cdiv
from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder, BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata

_new_metadata = sealed_factory(TritonAttentionMetadata)
"""``TritonAttentionMetadata(...)`` with every field, at the cost of a plain dataclass's ``__init__``."""
_from_last = sealed_replacer(TritonAttentionMetadata, "num_actual_tokens", "max_query_len", "max_seq_len", "causal",
                             "num_kv_splits")
"""The metadata of a build the last pass covers: the last metadata with the per-step host fields."""
_with_tables = sealed_replacer(TritonAttentionMetadata, "block_table_tensor", "slot_mapping")
"""``replace(md, block_table_tensor=..., slot_mapping=...)``, generated for the two fields."""

DEFAULT_NUM_SMS = 132
"""Streaming multiprocessors assumed when the device is not CUDA (the split-KV policy's
sizing; the interpreter gains nothing from splits, but the decision stays the same)."""


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`TritonAttentionMetadata` (see the module docstring).

    ``TritonMetadataBuilder(kv_cache_spec, layer_names, config, device)``: the kernel
    block size is ``kv_cache_spec.block_size`` (the runner passes the kernel spec);
    buffers hold ``config.max_num_reqs`` requests, ``config.max_num_batched_tokens``
    tokens and ``cdiv(config.max_model_len, block_size)`` blocks per request.

    Raises:
        MetadataError: a block size that is not one of the kernel block sizes
            (``TritonBackend.supported_kernel_block_sizes``), or non-positive limits.
    """

    cudagraph_support = AttentionCGSupport.ALWAYS
    reorder_batch_threshold = None
    supports_update_block_table = True
    supports_cascade = True  # full attention, eager builds (backends/triton/cascade.py)
    cascade_unsupported_reason = ""
    split_kv_policy: ClassVar[SplitKVPolicy] = SplitKVPolicy()
    """When to take the split-KV path; a subclass may override it (tests force splits)."""

    def __init__(self, kv_cache_spec, layer_names: list[str], config: BuilderConfig,
                 device: torch.device | str):
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.block_size = int(kv_cache_spec.block_size)
        self.num_kv_heads = int(getattr(kv_cache_spec, "num_kv_heads", 1))
        self.sliding_window = getattr(kv_cache_spec, "sliding_window", None)
        if self.block_size not in KERNEL_BLOCK_SIZES:
            raise MetadataError(
                f"TritonMetadataBuilder got block_size {self.block_size}: the kernels page by "
                f"{list(KERNEL_BLOCK_SIZES)} tokens; give it the kernel spec (the runner maps manager "
                "blocks to kernel blocks with TritonBackend.get_supported_kernel_block_size)")
        if min(config.max_num_reqs, config.max_num_batched_tokens, config.max_model_len) <= 0:
            raise MetadataError(f"TritonMetadataBuilder: BuilderConfig limits must be positive, got {config}")
        dev = self.device
        self.max_num_blocks_per_req = cdiv(config.max_model_len, self.block_size)
        self._query_start_loc = torch.zeros(config.max_num_reqs + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(config.max_num_reqs, dtype=torch.int32, device=dev)
        self._block_table = torch.full((config.max_num_reqs, self.max_num_blocks_per_req), NULL_BLOCK_ID,
                                       dtype=torch.int32, device=dev)
        self._slot_mapping = torch.full((config.max_num_batched_tokens,), PAD_SLOT_ID, dtype=torch.int64,
                                        device=dev)
        self.num_sms = DEFAULT_NUM_SMS
        if dev.type == "cuda" and torch.cuda.is_available():
            self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.validate_values = builder_values_checked()
        """Check the host values of every step (``ATTNPLUG_VALIDATE=1`` when created)."""
        self._step_checks = StepTensorChecks(
            device=dev, block_size=self.block_size, max_num_blocks_per_req=self.max_num_blocks_per_req,
            max_model_len=config.max_model_len, slot_capacity=config.max_num_batched_tokens, backend="triton")
        self._passed: tuple = NOT_PASSED + (None,)
        """The last checked eager build's structural pass (``StepTensorChecks.pass_step``)
        and its metadata: a build whose four tensors and row count are the
        same and whose host ints fit the pass's bounds skips the checks, and its metadata
        is a copy of it with the five per-step fields set (``_from_last``). Never set with
        ``validate_values`` (every build is then checked in full)."""
        self._tables_passed: tuple = NOT_PASSED[:5]
        """``StepTensorChecks.pass_tables`` of the last ``update_block_table``."""
        self._unsplit_num_reqs = self.split_kv_policy.saturating_num_reqs(self.num_kv_heads, self.num_sms)
        """From this many requests on, the split-KV decision is 1 (the policy's bound)."""

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TritonAttentionMetadata:
        """Lower the step's metadata: its tensors are passed through (never mutated, never copied).

        Args:
            common_prefix_len: tokens every request shares at the start of its KV (the
                runner's, ``runner/execute/cascade.py``); clamped to the smallest
                ``num_computed_tokens`` and rounded down to the block size, a positive
                value adds the cascade passes' tensors (``metadata.cascade``: three small
                device kernels, no copy from the host; ``backends/triton/cascade.py``).
                Ignored with a sliding window.
            common_attn_metadata: the step's metadata for this group (kernel block table).
            fast_build: ignored (a build is already only host-int arithmetic).

        Returns:
            The metadata every layer of the group passes to ``forward``; its tensors are
            the step's own (``query_start_loc[:num_reqs + 1]``, ``seq_lens[:num_reqs]``, the
            block table and slot mapping as given), valid as long as the step's.

        Raises:
            MetadataError: sizes, dtypes or devices that do not fit each other or the
                builder's limits; with ``ATTNPLUG_VALIDATE=1`` also host values that disagree
                (``backends/common/buffer_checks.py``).

        Without cascade, does not synchronise with the host and launches no device work.
        """
        cm = common_attn_metadata
        n, qsl, seq_lens = cm.num_reqs, cm.query_start_loc, cm.seq_lens
        block_table, slot_mapping = cm.block_table_tensor, cm.slot_mapping
        num_actual_tokens, max_query_len, max_seq_len = cm.num_actual_tokens, cm.max_query_len, cm.max_seq_len
        splits = (1 if n >= self._unsplit_num_reqs else
                  self.split_kv_policy.num_kv_splits(n, self.num_kv_heads, max_query_len, max_seq_len, self.num_sms))
        p_qsl, p_seq_lens, p_bt, p_sm, p_n, p_tokens, p_seq_len, template = self._passed
        if (p_qsl is qsl and p_seq_lens is seq_lens and p_bt is block_table and p_sm is slot_mapping
                and p_n == n and num_actual_tokens <= p_tokens and max_seq_len <= p_seq_len):
            md = _from_last(template, num_actual_tokens, max_query_len, max_seq_len, cm.causal, splits)
        else:
            md = self._build_checked(cm, n, splits)  # raises, or keeps the new pass
        return md if common_prefix_len <= 0 else with_cascade(md, cm, common_prefix_len, self.sliding_window)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Build for a step that captures or replays a CUDA graph (the runner's padded metadata).

        The tensors are copied into the builder's persistent buffers (the block table's
        live columns, ``cdiv(max_seq_len, block_size)``, only), so every graph build returns
        the same addresses. A graph bakes in the host ints of the capture, so they are
        bounds that hold for every replay of the same padded shape: ``num_reqs`` is the
        padded request count (rows of ``query_start_loc`` - 1; padded requests have empty
        queries and are skipped by the kernel), and the split-KV decision assumes contexts
        up to ``max_model_len``. Any tile size or split count gives the same result; only
        speed depends on them.

        Raises:
            MetadataError: as :meth:`build` (raised before anything is copied).
        """
        cm = common_attn_metadata
        n = cm.query_start_loc.shape[0] - 1
        self._check(cm, n)
        qsl = self._query_start_loc[: n + 1]
        qsl.copy_(cm.query_start_loc[: n + 1], non_blocking=True)
        seq_lens = self._seq_lens[:n]
        seq_lens.copy_(cm.seq_lens[:n], non_blocking=True)
        block_table = copy_block_table(self._block_table, cm.block_table_tensor, n,
                                       cdiv(cm.max_seq_len, self.block_size))
        slot_mapping = self._copy_slot_mapping(cm.slot_mapping)
        return self._metadata(cm, n, self.config.max_model_len, qsl, seq_lens, block_table, slot_mapping, True)

    def _metadata(self, cm: CommonAttentionMetadata, n: int, split_seq_len: int, qsl: torch.Tensor,
                  seq_lens: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                  graph: bool) -> TritonAttentionMetadata:
        max_query_len = cm.max_query_len
        splits = self.split_kv_policy.num_kv_splits(n, self.num_kv_heads, max_query_len, split_seq_len, self.num_sms)
        return _new_metadata(n, cm.num_actual_tokens, max_query_len, cm.max_seq_len, self.block_size, cm.causal,
                             qsl, seq_lens, block_table, slot_mapping, splits, graph, None)

    def update_block_table(self, metadata: TritonAttentionMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> TritonAttentionMetadata:
        """A copy of ``metadata`` (built by a builder of this class for a group with the same
        spec) reading ``block_table`` and writing ``slot_mapping``.

        An eager ``metadata`` gets the two tensors as given; a CUDA-graph one
        (``metadata.graph``) gets them copied into this builder's persistent buffers (live
        columns only), with ``query_start_loc`` / ``seq_lens`` copied there too, so the
        graph reads fixed addresses.

        Args:
            metadata: the other group's metadata; not mutated.
            block_table: ``[>= num_reqs, max_num_blocks_per_req]``, ``torch.int32``, device.
            slot_mapping: ``[num_tokens]``, ``torch.int64``, device.

        Raises:
            MetadataError: a block table or slot mapping that does not fit ``metadata``
                (nothing is copied then).

        Does not synchronise with the host; graph-safe.
        """
        n = metadata.num_reqs
        p_bt, p_sm, p_rows, p_tokens, p_seq_len = self._tables_passed
        if (p_bt is not block_table or p_sm is not slot_mapping or n > p_rows
                or metadata.num_actual_tokens > p_tokens or metadata.max_seq_len > p_seq_len):
            self._tables_passed = self._step_checks.pass_tables(block_table, slot_mapping, n,
                                                                metadata.num_actual_tokens, metadata.max_seq_len)
        if metadata.block_size != self.block_size:
            raise MetadataError(
                f"update_block_table: metadata has block_size {metadata.block_size}, this builder "
                f"{self.block_size}: only groups with the same spec may share a build")
        if not metadata.graph:
            md = _with_tables(metadata, block_table, slot_mapping)
            if md.cascade is not None:  # the passes read this group's blocks
                md = dataclasses.replace(md, cascade=cascade_fields(md, md.cascade.common_prefix_len))
            return md
        qsl = self._query_start_loc[: n + 1]
        if qsl.data_ptr() != metadata.query_start_loc.data_ptr():
            qsl.copy_(metadata.query_start_loc, non_blocking=True)
        seq_lens = self._seq_lens[:n]
        if seq_lens.data_ptr() != metadata.seq_lens.data_ptr():
            seq_lens.copy_(metadata.seq_lens, non_blocking=True)
        return dataclasses.replace(
            metadata, query_start_loc=qsl, seq_lens=seq_lens,
            block_table_tensor=copy_block_table(self._block_table, block_table, n,
                                                cdiv(metadata.max_seq_len, self.block_size)),
            slot_mapping=self._copy_slot_mapping(slot_mapping))

    # --- copies into the persistent buffers (graph builds, after validation) --------------
    def _copy_slot_mapping(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        view = self._slot_mapping[: slot_mapping.shape[0]]
        view.copy_(slot_mapping, non_blocking=True)
        return view

    # --- validation (raises before anything is copied) ---------------------------------
    def _build_checked(self, cm: CommonAttentionMetadata, n: int, splits: int) -> TritonAttentionMetadata:
        """An eager build the last pass does not cover: the row bound, with ``validate_values``
        the host values, the structure in full (``StepTensorChecks.pass_step``); then the
        metadata, which becomes the template of the builds the new pass
        covers (kept unless every build is checked)."""
        self._check_num_reqs(n)
        if self.validate_values:
            check_step_tensors(cm, n, self.device, "triton")  # (the host copies' sizes first)
            check_step_values(cm)
        passed = self._step_checks.pass_step(cm, n)
        qsl, seq_lens = cm.query_start_loc, cm.seq_lens
        md = _new_metadata(n, cm.num_actual_tokens, cm.max_query_len, cm.max_seq_len, self.block_size, cm.causal,
                           qsl if qsl.shape[0] == n + 1 else qsl[: n + 1],
                           seq_lens if seq_lens.shape[0] == n else seq_lens[:n],
                           cm.block_table_tensor, cm.slot_mapping, splits, False, None)
        if not self.validate_values:
            self._passed = passed + (md,)
        return md

    def _check(self, cm: CommonAttentionMetadata, n: int) -> None:
        self._check_num_reqs(n)
        if self.validate_values:
            check_step_tensors(cm, n, self.device, "triton")
            check_step_values(cm)
        self._step_checks.check(cm, n)

    def _check_num_reqs(self, n: int) -> None:
        if n > self.config.max_num_reqs:
            raise MetadataError(
                f"{n} request rows exceed BuilderConfig.max_num_reqs={self.config.max_num_reqs}: the persistent "
                "buffers hold that many requests; raise max_num_reqs (max_num_seqs) when creating the runner.")
