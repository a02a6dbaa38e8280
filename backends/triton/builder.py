"""``TritonMetadataBuilder``: copies each step's metadata into persistent device buffers.

The buffers are allocated once, at the sizes of the :class:`BuilderConfig`, so the
metadata tensors have the same addresses every step and a CUDA graph captured over the
attention of any batch (mixed prefill and decode included) replays correctly:
``cudagraph_support = ALWAYS``. A build is a few device-to-device copies and host-int
arithmetic; it never synchronises with the host.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from attnplug.backends.common.buffer_checks import check_block_table, check_slot_mapping, copy_block_table
from attnplug.backends.triton.constants import KERNEL_BLOCK_SIZES
from attnplug.backends.triton.metadata import SplitKVPolicy, TritonAttentionMetadata
from attnplug.cache_groups.specs import cdiv
from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder, BuilderConfig
from attnplug.core.devices import same_device
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata

DEFAULT_NUM_SMS = 132
"""Streaming multiprocessors assumed when the device is not CUDA (the split-KV policy's
sizing; the interpreter gains nothing from splits, but the decision stays the same)."""


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`TritonAttentionMetadata` into persistent buffers.

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
    split_kv_policy: ClassVar[SplitKVPolicy] = SplitKVPolicy()
    """When to take the split-KV path; a subclass may override it (tests force splits)."""

    def __init__(self, kv_cache_spec, layer_names: list[str], config: BuilderConfig,
                 device: torch.device | str):
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.block_size = int(kv_cache_spec.block_size)
        self.num_kv_heads = int(getattr(kv_cache_spec, "num_kv_heads", 1))
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

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TritonAttentionMetadata:
        """Copy the step's metadata into this builder's buffers (never mutates the input).

        Args:
            common_prefix_len: ignored (no cascade attention).
            common_attn_metadata: the step's metadata for this group (kernel block table).
            fast_build: ignored (a build is already only a few copies).

        Returns:
            The metadata every layer of the group passes to ``forward``.

        Raises:
            MetadataError: sizes that disagree with each other or exceed the buffers; nothing
                is copied then.

        Does not synchronise with the host (reads host ints and ``_cpu`` tensors only);
        the returned tensors are views of persistent buffers.
        """
        cm = common_attn_metadata
        return self._build(cm, cm.num_reqs, cm.max_seq_len)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Build for a step that captures or replays a CUDA graph (the runner's padded metadata).

        A graph bakes in the host ints of the capture, so they are bounds that hold for every
        replay of the same padded shape: ``num_reqs`` is the padded request count (rows of
        ``query_start_loc`` - 1; padded requests have empty queries and are skipped by the
        kernel), and the split-KV decision assumes contexts up to ``max_model_len``. Any
        tile size or split count gives the same result; only speed depends on them.

        Raises:
            MetadataError: as :meth:`build`.
        """
        cm = common_attn_metadata
        return self._build(cm, cm.query_start_loc.shape[0] - 1, self.config.max_model_len)

    def _build(self, cm: CommonAttentionMetadata, n: int, split_seq_len: int) -> TritonAttentionMetadata:
        self._check(cm, n)
        qsl = self._query_start_loc[: n + 1]
        qsl.copy_(cm.query_start_loc[: n + 1], non_blocking=True)
        seq_lens = self._seq_lens[:n]
        seq_lens.copy_(cm.seq_lens[:n], non_blocking=True)
        block_table = copy_block_table(self._block_table, cm.block_table_tensor, n)
        slot_mapping = self._copy_slot_mapping(cm.slot_mapping)
        splits = self.split_kv_policy.num_kv_splits(
            num_reqs=n, num_kv_heads=self.num_kv_heads, max_query_len=cm.max_query_len,
            max_seq_len=split_seq_len, num_sms=self.num_sms)
        return TritonAttentionMetadata(
            num_reqs=n, num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len, block_size=self.block_size, causal=cm.causal,
            query_start_loc=qsl, seq_lens=seq_lens, block_table_tensor=block_table,
            slot_mapping=slot_mapping, num_kv_splits=splits)

    def update_block_table(self, metadata: TritonAttentionMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> TritonAttentionMetadata:
        """A copy of ``metadata`` (built by a builder of this class for a group with the same
        spec) reading ``block_table`` and writing ``slot_mapping``, in this builder's buffers.

        Args:
            metadata: the other group's metadata; not mutated.
            block_table: ``[>= num_reqs, max_num_blocks_per_req]``, ``torch.int32``, device.
            slot_mapping: ``[num_tokens]``, ``torch.int64``, device.

        Raises:
            MetadataError: a block table or slot mapping that does not fit ``metadata``.

        Does not synchronise with the host; graph-safe.
        """
        n = metadata.num_reqs
        self._check_block_table(block_table, n, metadata.max_seq_len)
        self._check_slot_mapping(slot_mapping, metadata.num_actual_tokens)
        if metadata.block_size != self.block_size:
            raise MetadataError(
                f"update_block_table: metadata has block_size {metadata.block_size}, this builder "
                f"{self.block_size}: only groups with the same spec may share a build")
        qsl = self._query_start_loc[: n + 1]
        if qsl.data_ptr() != metadata.query_start_loc.data_ptr():
            qsl.copy_(metadata.query_start_loc, non_blocking=True)
        seq_lens = self._seq_lens[:n]
        if seq_lens.data_ptr() != metadata.seq_lens.data_ptr():
            seq_lens.copy_(metadata.seq_lens, non_blocking=True)
        return dataclasses.replace(
            metadata, query_start_loc=qsl, seq_lens=seq_lens,
            block_table_tensor=copy_block_table(self._block_table, block_table, n),
            slot_mapping=self._copy_slot_mapping(slot_mapping))

    # --- copies into the persistent buffers (after validation) ---------------------------
    def _copy_slot_mapping(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        view = self._slot_mapping[: slot_mapping.shape[0]]
        view.copy_(slot_mapping, non_blocking=True)
        return view

    # --- validation (raises before anything is copied) ---------------------------------
    def _check(self, cm: CommonAttentionMetadata, n: int) -> None:
        cfg = self.config
        if n > cfg.max_num_reqs:
            raise MetadataError(
                f"{n} request rows exceed BuilderConfig.max_num_reqs={cfg.max_num_reqs}: the persistent buffers "
                "hold that many requests; raise max_num_reqs (max_num_seqs) when creating the runner.")
        if cm.query_start_loc.shape[0] < n + 1 or cm.seq_lens.shape[0] < n or cm.query_start_loc_cpu.shape[0] < n + 1:
            raise MetadataError(
                f"query_start_loc has {cm.query_start_loc.shape[0]} entries and seq_lens {cm.seq_lens.shape[0]} "
                f"but num_reqs={n}: expected >= num_reqs + 1 and >= num_reqs.")
        for name, t, dtype in (("query_start_loc", cm.query_start_loc, torch.int32),
                               ("seq_lens", cm.seq_lens, torch.int32)):
            if t.dtype != dtype or not same_device(t.device, self.device):
                raise MetadataError(f"{name} is {t.dtype} on {t.device}; the triton builder needs {dtype} on "
                                    f"{self.device} (the compute device).")
        qsl = cm.query_start_loc_cpu[: n + 1].long()
        if int(qsl[-1]) != cm.num_actual_tokens:
            raise MetadataError(
                f"query_start_loc_cpu[num_reqs]={int(qsl[-1])} but num_actual_tokens={cm.num_actual_tokens}: "
                "they must agree (the flat token count).")
        query_lens = qsl[1:] - qsl[:-1]
        seq_lens = cm.seq_lens_cpu[:n].long()
        bad = (query_lens < 0) | (seq_lens < query_lens)
        if n and bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise MetadataError(
                f"request {i}: query length {int(query_lens[i])} with seq_len {int(seq_lens[i])}: need "
                "0 <= query_len <= seq_len (seq_len = num_computed_tokens + query_len).")
        if n and int(seq_lens.max()) > cm.max_seq_len:
            raise MetadataError(f"max_seq_len={cm.max_seq_len} but seq_lens holds {int(seq_lens.max())}: "
                                "max_seq_len must bound every seq_len.")
        if n and int(query_lens.max()) > cm.max_query_len:
            raise MetadataError(f"max_query_len={cm.max_query_len} but a query has {int(query_lens.max())} "
                                "tokens: max_query_len must bound every query length.")
        self._check_slot_mapping(cm.slot_mapping, cm.num_actual_tokens)
        self._check_block_table(cm.block_table_tensor, n, cm.max_seq_len)

    def _check_slot_mapping(self, slot_mapping: torch.Tensor, num_actual_tokens: int) -> None:
        check_slot_mapping(slot_mapping, num_actual_tokens, self._slot_mapping.shape[0], self.device)

    def _check_block_table(self, block_table: torch.Tensor, num_reqs: int, max_seq_len: int) -> None:
        check_block_table(block_table, num_reqs, max_seq_len, block_size=self.block_size,
                          max_num_blocks_per_req=self.max_num_blocks_per_req,
                          max_model_len=self.config.max_model_len, device=self.device, backend="triton")
