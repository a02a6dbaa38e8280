"""``TorchNativeMetadata`` and its builder: the per-step index tensors ``forward`` needs.

The builder runs once per step per cache group and turns the
:class:`~attnplug.core.metadata.CommonAttentionMetadata` into plain index tensors, so
that ``forward`` (once per layer) only gathers, multiplies and scatters, without host
synchronisation.

Requests are split into *segments* attended in one batched op each:

* every single-token query (decode) goes into one segment, keys padded to the longest;
* every multi-token query (prefill or chunked-prefill continuation) is its own segment.

So no query is ever padded, and key padding only happens among decodes (cheap).

Sliding-window groups (a :class:`~attnplug.cache_groups.specs.SlidingWindowSpec`): a
segment's key range starts at each request's window, not at position 0. Request ``r``'s
keys begin at its first block any of its queries can see,
``num_skipped_blocks(seq_len - query_len, W, B)`` — exactly the blocks the block pool
has not freed — so the impl never reads a freed (null, possibly reused) block, and a
decode reads ``O(W)`` keys (at most ``cdiv(W, B) + 1`` blocks), not ``O(seq_len)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from attnplug.backends.common.buffer_checks import builder_values_checked, check_step_values
from attnplug.backends.torch_native.segments import (
    DecodeConstants,
    all_decode_segment,
    decode_segment,
    key_block_ids,
    prefill_segments,
)
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class AttentionSegment:
    """Requests attended together: same query length, keys padded to ``max_seq_len``.

    ``n`` below is the number of requests in the segment. Every tensor is on the
    compute device.
    """

    req_indices: torch.Tensor
    """``[n]``, ``torch.int64``: the segment's rows in the batch (block-table rows)."""

    query_len: int
    """Query tokens per request in this segment (tokens)."""

    max_seq_len: int
    """Key columns: the longest ``seq_len`` in the segment (tokens)."""

    min_seq_len: int
    """The shortest ``seq_len`` in the segment (tokens); bounds the keys a window can see."""

    query_token_indices: torch.Tensor
    """``[n, query_len]``, ``torch.int64``: row of the flat token stream (``query``,
    ``output``) of each query token."""

    query_positions: torch.Tensor
    """``[n, query_len]``, ``torch.int64``; units: token position in the request,
    ``seq_len - query_len + j`` (bottom-right aligned)."""

    seq_lens: torch.Tensor
    """``[n]``, ``torch.int64``; units: tokens of KV per request after this step."""

    key_block_ids: torch.Tensor
    """``[n, num_key_blocks]``, ``torch.int32`` (decode segment: the block table's dtype) or
    ``torch.int64`` (a view of the block table: ``row_start`` segments): each request's
    physical blocks in logical order from logical block ``key_offsets[r] // block_size`` on
    (its block-table row, cut to the segment's key range). Entries past a request's ``cdiv(seq_len, block_size)`` are valid block ids
    whose keys are never used (``NULL_BLOCK_ID``, or in the decode segment what the block
    table holds there: null or the request's own blocks; ``attention.keys_used`` masks
    them). Full attention: ``num_key_blocks = cdiv(max_seq_len, block_size)``; sliding
    window: at most ``cdiv(W + query_len - 1, block_size) + 1``."""

    key_offsets: torch.Tensor
    """``[n]``, ``torch.int64``; units: token positions, multiples of ``block_size``. Key
    column ``j`` of request ``r`` is key position ``key_offsets[r] + j``. All zero for
    full attention; the first block of the window for a sliding-window group."""

    min_key_offset: int
    """``min(key_offsets)`` (tokens)."""

    max_key_offset: int
    """``max(key_offsets)`` (tokens)."""

    key_block_columns: torch.Tensor | None
    """``[n, num_key_blocks]``, ``torch.int64``: the block-table column each entry of
    ``key_block_ids`` comes from (0 where ``key_block_live`` is False). The same for every
    group with this spec, so ``update_block_table`` only gathers new ids. ``None`` when
    ``row_start`` is set."""

    key_block_live: torch.Tensor | None
    """``[n, num_key_blocks]``, ``torch.bool``: the entry is one of the request's blocks
    (False past its ``cdiv(seq_len, block_size)``). ``None`` when ``row_start`` is set."""

    row_start: int | None = None
    """Set when the segment's rows are ``row_start .. row_start + n - 1`` and it reads
    block-table columns ``col_start .. col_start + num_key_blocks - 1``, all of them live
    (full-attention decodes in consecutive rows, every prefill row): ``key_block_ids`` is
    then a view of the block table."""

    col_start: int = 0
    """The first block-table column a ``row_start`` segment reads (``key_offsets //
    block_size``; 0 for full attention)."""


@dataclass(frozen=True)
class TorchNativeMetadata:
    """What every ``torch_native`` layer of a cache group reads in one step."""

    num_reqs: int
    """Real (non-padded) requests."""
    num_actual_tokens: int
    """Real (non-padded) tokens; rows past it are never read or written."""
    max_query_len: int
    """Longest query this step (tokens)."""
    max_seq_len: int
    """Longest ``seq_len`` this step (tokens)."""
    block_size: int
    """Tokens per (kernel) block; must equal ``kv_cache.shape[2]``."""
    sliding_window: int | None
    """``W`` of the group's spec (tokens, current included) when the key ranges were
    trimmed to the window; ``None`` for full attention (keys start at 0)."""
    causal: bool
    """Bottom-right aligned causal attention (see ``attention.visibility_mask``)."""
    query_start_loc: torch.Tensor
    """``[num_reqs + 1]``, ``torch.int32``, compute device (as given; for inspection)."""
    seq_lens: torch.Tensor
    """``[num_reqs]``, ``torch.int32``, compute device (as given; for inspection)."""
    block_table_tensor: torch.Tensor
    """``[num_reqs, max_num_blocks_per_req]``, ``torch.int32``, compute device."""
    slot_mapping: torch.Tensor
    """``[num_tokens]``, ``torch.int64``, compute device; ``PAD_SLOT_ID`` = not written."""
    write_token_indices: torch.Tensor
    """``[num_writes]``, ``torch.int64``: token rows whose K/V is written (real slots only)."""
    write_slots: torch.Tensor
    """``[num_writes]``, ``torch.int64``: the slot each of those rows is written to."""
    segments: tuple[AttentionSegment, ...]
    """The attention work of the step, see the module docstring."""
    cascade: object | None = None
    """``backends/torch_native/cascade.py``'s ``TorchNativeCascade`` when the step runs
    cascade attention (then ``segments`` cover each request's suffix only)."""


def _write_indices(slot_mapping: torch.Tensor, num_actual_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows with a real slot, and those slots (``PAD_SLOT_ID`` rows dropped).

    Synchronises with the host (``nonzero``); runs once per step, in the builder.
    """
    real = slot_mapping[:num_actual_tokens]
    token_indices = torch.nonzero(real != PAD_SLOT_ID).flatten()
    return token_indices, real.index_select(0, token_indices).long()


class TorchNativeMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`TorchNativeMetadata`; see the module docstring.

    ``Builder(kv_cache_spec, layer_names, config, device)``: the block size is
    ``kv_cache_spec.block_size`` (``torch_native`` accepts any kernel block size, so
    kernel blocks are manager blocks).
    """

    cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = None
    supports_update_block_table = True
    supports_cascade = True  # full attention only (backends/torch_native/cascade.py)

    def __init__(self, kv_cache_spec, layer_names: list[str], config, device: torch.device | str):
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.validate_values = builder_values_checked()
        """Check the host values of every step (``ATTNPLUG_VALIDATE=1`` when created)."""
        self._decode_constants = DecodeConstants(getattr(config, "max_num_reqs", 1), self.device)

    @property
    def block_size(self) -> int:
        return int(self.kv_cache_spec.block_size)

    @property
    def sliding_window(self) -> int | None:
        """``W`` of a sliding-window spec (key ranges start at the window), else ``None``."""
        return getattr(self.kv_cache_spec, "sliding_window", None)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TorchNativeMetadata:
        """Lower ``common_attn_metadata`` into :class:`TorchNativeMetadata` (never mutates it).

        Args:
            common_prefix_len: tokens every request shares at the start of its KV: with
                ``> 0`` (full attention only) the step runs cascade attention
                (``backends/torch_native/cascade.py``); clamped like flash_attn's.
            common_attn_metadata: the step's metadata for this group.
            fast_build: ignored.

        Returns:
            The metadata every layer of the group passes to ``forward``.

        Raises:
            MetadataError: inconsistent sizes (see :meth:`_check`).

        Synchronises with the host (reads the ``_cpu`` fields, one ``nonzero``).
        """
        cm = common_attn_metadata
        self._check(cm)
        if common_prefix_len > 0 and self.sliding_window is None and cm.num_reqs:
            from attnplug.backends.torch_native.cascade import build_cascade
            return build_cascade(self, cm, common_prefix_len)
        num_reqs = cm.num_reqs
        seq_np = cm.seq_lens_cpu[:num_reqs].numpy()
        block_table = cm.block_table_tensor
        B, window, dev = self.block_size, self.sliding_window, self.device
        if num_reqs and cm.num_actual_tokens == num_reqs and cm.max_query_len == 1 and window is None:
            # every row decodes (host ints: num_reqs tokens, none longer than 1; checked values
            # with ATTNPLUG_VALIDATE=1): no per-row scan of the query lengths
            segment = all_decode_segment(AttentionSegment, block_table, seq_np, B, self._decode_constants, dev)
            return self._metadata(cm, window, (segment,))
        qsl_np = cm.query_start_loc_cpu[: num_reqs + 1].numpy()
        query_lens = np.diff(qsl_np)
        segments = []
        decodes = np.flatnonzero(query_lens == 1)
        if decodes.shape[0]:
            segments.append(decode_segment(AttentionSegment, block_table, decodes, qsl_np, seq_np, B, window, dev))
        prefills = np.flatnonzero(query_lens > 1)
        if prefills.shape[0]:
            segments += prefill_segments(AttentionSegment, block_table, prefills, qsl_np, seq_np, query_lens, B,
                                         window, dev)

        return self._metadata(cm, window, tuple(segments))

    def _metadata(self, cm: CommonAttentionMetadata, window: int | None,
                  segments: tuple[AttentionSegment, ...]) -> TorchNativeMetadata:
        write_tokens, write_slots = _write_indices(cm.slot_mapping, cm.num_actual_tokens)
        return TorchNativeMetadata(
            num_reqs=cm.num_reqs,
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            block_size=self.block_size,
            sliding_window=window,
            causal=cm.causal,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table_tensor=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            write_token_indices=write_tokens,
            write_slots=write_slots,
            segments=segments,
        )

    def update_block_table(self, metadata: TorchNativeMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> TorchNativeMetadata:
        """A copy of ``metadata`` that reads ``block_table`` and writes ``slot_mapping``.

        Args:
            metadata: built by a builder of the same class for a group with the same spec.
            block_table: ``[num_reqs, max_num_blocks_per_req]``, ``torch.int32``, device.
            slot_mapping: ``[num_tokens]``, ``torch.int64``, device.

        Raises:
            MetadataError: a block table with too few rows or columns.

        ``metadata`` is not mutated. No host synchronisation: which tokens carry a real
        slot is a fact of the step (only padded tokens carry ``PAD_SLOT_ID``), the same in
        every attention group, so ``write_token_indices`` is reused and only the slots are
        gathered anew.
        """
        self._check_block_table(block_table, metadata.num_reqs, metadata.max_seq_len)
        segments = tuple(
            dataclasses.replace(seg, key_block_ids=(
                block_table[seg.row_start: seg.row_start + seg.key_block_ids.shape[0],
                            seg.col_start: seg.col_start + seg.key_block_ids.shape[1]]
                if seg.row_start is not None else
                key_block_ids(block_table, seg.req_indices, seg.key_block_columns, seg.key_block_live)))
            for seg in metadata.segments)
        write_slots = slot_mapping.index_select(0, metadata.write_token_indices).long()
        return dataclasses.replace(metadata, block_table_tensor=block_table, slot_mapping=slot_mapping,
                                   write_slots=write_slots, segments=segments)

    def _check_block_table(self, block_table: torch.Tensor, num_reqs: int, max_seq_len: int) -> None:
        if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
            raise MetadataError(
                f"block_table_tensor has shape {tuple(block_table.shape)} but num_reqs={num_reqs}: "
                "torch_native needs one row per request; pass [num_reqs, max_num_blocks_per_req].")
        capacity = block_table.shape[1] * self.block_size
        if max_seq_len > capacity:
            raise MetadataError(
                f"block_table_tensor has {block_table.shape[1]} blocks of {self.block_size} tokens "
                f"per row ({capacity} tokens) but max_seq_len={max_seq_len}: the keys would be "
                "unaddressable; allocate enough blocks per request (or check the block size).")

    def _check(self, cm: CommonAttentionMetadata) -> None:
        """Raise :class:`MetadataError` when the sizes of ``cm`` disagree (host values too
        with ``ATTNPLUG_VALIDATE=1``: ``backends/common/buffer_checks.py``)."""
        n = cm.num_reqs
        if cm.query_start_loc_cpu.shape[0] < n + 1 or cm.seq_lens_cpu.shape[0] < n:
            raise MetadataError(
                f"query_start_loc_cpu has {cm.query_start_loc_cpu.shape[0]} entries and seq_lens_cpu "
                f"{cm.seq_lens_cpu.shape[0]} but num_reqs={n}: expected >= num_reqs + 1 and >= num_reqs.")
        if cm.slot_mapping.shape[0] < cm.num_actual_tokens:
            raise MetadataError(
                f"slot_mapping has {cm.slot_mapping.shape[0]} entries but num_actual_tokens="
                f"{cm.num_actual_tokens}: one slot per scheduled token is required.")
        if self.validate_values:
            check_step_values(cm)
        self._check_block_table(cm.block_table_tensor, n, cm.max_seq_len if n else 0)
