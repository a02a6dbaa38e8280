"""``Mamba2Metadata`` and its builder: per-step state slots, decode/prefill split, chunk layout.

Rows are split decodes-first (``reorder_batch_threshold = 1``: the runner moves every
one-token row before the others): rows ``0 .. num_decodes - 1`` take one token each and
use the recurrent update; the remaining rows (the *prefill part*) use the varlen causal
conv1d and the chunked SSD scan. ``num_decodes`` is the length of the leading run of
one-token rows, so a batch the runner did not reorder is still served correctly (a
one-token row behind a prefill row goes through the prefill path).

A row's state slot is its block id in the group's block table (column 0): the Mamba
group's block manager gives each request exactly one block, from admission until it
finishes or is preempted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from attnplug.backends.mamba2.layout import PrefillLayout, compute_prefill_layout, max_num_chunks
from attnplug.backends.mamba2.verify import compute_verify_layout
from attnplug.cache_groups.buffers import CpuGpuBuffer, upload
from attnplug.core import switches
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, AttentionMetadataBuilder, BuilderConfig
from attnplug.core.errors import KVCacheSpecError, MetadataError
from attnplug.core.metadata import CommonAttentionMetadata

_DEVICE_FIELDS = ("chunk_grid_index", "chunk_token_index", "token_chunk_index", "conv_token_pos", "conv_state_pos",
                  "conv_final_pos", "conv_window_pos")
"""The layout arrays the impl reads on the device: packed with ``has_initial_state`` and
``fresh_rows`` into one host buffer, uploaded with one copy."""
_HOST_FIELDS = ("seq_idx", "cu_chunk_seqlen", "chunk_seq_idx", "last_chunk_indices")
"""Layout arrays no kernel here reads: kept as host numpy, never uploaded."""
_EMPTY_HOST = np.zeros(0, dtype=np.int64)
_ZERO_HOST = np.zeros(1, dtype=np.int64)


@dataclass(frozen=True)
class Mamba2Metadata:
    """What every Mamba2 layer of a cache group reads in one step.

    Tensors are on the compute device unless marked CPU; index tensors are ``torch.int64``
    unless stated. Token indices of the prefill part count from its first token
    (``num_decode_tokens`` in the step's flat stream).
    """

    num_reqs: int
    """Real (non-padded) rows."""
    num_actual_tokens: int
    """Real tokens; rows past it are never read or written."""
    num_decodes: int
    """Rows ``0 .. num_decodes - 1``: one token each, recurrent update."""
    num_prefills: int
    """Rows ``num_decodes .. num_reqs - 1``: varlen conv1d + chunked scan."""
    num_decode_tokens: int
    """``== num_decodes`` (tokens)."""
    num_prefill_tokens: int
    """``num_actual_tokens - num_decode_tokens`` (tokens)."""
    chunk_size: int
    """Scan chunk length (tokens), from the spec; boundaries at absolute positions that
    are multiples of it."""
    num_chunks: int
    """Chunks of the prefill part."""
    max_chunks_per_seq: int
    """Most chunks of one prefill sequence (width of the inter-chunk grid)."""
    state_indices: torch.Tensor
    """``[num_reqs_padded]``, ``torch.int32``: each row's state slot (block-table column 0);
    rows ``>= num_reqs`` of a padded block table hold ``PAD_SLOT_ID``."""
    has_initial_state: torch.Tensor
    """``[num_reqs]``, ``torch.bool``: ``num_computed_tokens > 0`` (the slot holds the
    state after the request's computed tokens; else the step starts from zeros)."""
    fresh_rows: torch.Tensor
    """``[num_fresh]``: the rows with ``has_initial_state`` False (their slots are zeroed
    before use: a slot's previous owner left stale values)."""
    query_start_loc_p: torch.Tensor
    """``[num_prefills + 1]``, ``torch.int32``: exclusive prefix sum of the prefill rows'
    query lengths, from 0 (prefill-part token offsets)."""
    query_start_loc_p_cpu: np.ndarray
    """``[num_prefills + 1]``, ``int64``, CPU numpy: host copy of ``query_start_loc_p``."""
    seq_idx: np.ndarray
    """``[num_prefill_tokens]``: prefill sequence (0-based) of each prefill token; ``int64`` CPU numpy (no kernel reads it on the device)."""
    cu_chunk_seqlen: np.ndarray
    """``[num_chunks + 1]``: prefill-token offset where each chunk starts (last: the count); ``int64`` CPU numpy (no kernel reads it on the device)."""
    chunk_seq_idx: np.ndarray
    """``[num_chunks]``: the prefill sequence of each chunk; ``int64`` CPU numpy (no kernel reads it on the device)."""
    last_chunk_indices: np.ndarray
    """``[num_prefills]``: each sequence's last chunk (``-1`` if it has no token); ``int64`` CPU numpy (no kernel reads it on the device)."""
    chunk_grid_index: torch.Tensor
    """``[num_chunks]``: ``seq * max_chunks_per_seq + j`` for chunk ``j`` of ``seq``."""
    chunk_token_index: torch.Tensor
    """``[num_chunks * chunk_size]``: prefill token in each chunk row; padding rows hold
    ``num_prefill_tokens`` (a zero row)."""
    token_chunk_index: torch.Tensor
    """``[num_prefill_tokens]``: each token's chunk row (inverse of ``chunk_token_index``)."""
    conv_token_pos: torch.Tensor
    """``[num_prefill_tokens]``: row of each token in the extended conv stream (every
    sequence preceded by its ``conv_kernel_size - 1`` state columns)."""
    conv_state_pos: torch.Tensor
    """``[num_prefills * (conv_kernel_size - 1)]``: extended rows of the initial states."""
    conv_final_pos: torch.Tensor
    """``[num_prefills * (conv_kernel_size - 1)]``: extended rows of the new conv states."""
    conv_window_pos: torch.Tensor
    """``[num_prefill_tokens * conv_kernel_size]``: each token's conv window, oldest first."""
    block_table_tensor: torch.Tensor
    """``[num_reqs_padded, max_num_blocks_per_req]``, ``torch.int32``: the group's table."""
    # --- speculative decoding (``backends/mamba2/verify.py``); defaults: a step without drafts
    num_verify_rows: int = 0
    """``Rv``: rows verifying ``d >= 1`` drafts (query length ``1 + d``). When ``> 0`` the
    prefill part's fields above (``num_prefills``, ``num_prefill_tokens``, the chunk
    layout, ``query_start_loc_p``) describe only its *plain* rows, gathered by
    ``prefill_rows`` / ``prefill_token_index``; ``num_decodes + num_prefills +
    num_verify_rows == num_reqs``."""
    max_verify_len: int = 0
    """``L = 1 + max d`` (positions per verifying row in the grid)."""
    verify_rows: torch.Tensor | None = None
    """``[Rv]``: batch rows of the verifying rows."""
    verify_token_index: torch.Tensor | None = None
    """``[Rv * L]``: the flat-stream token at each grid entry (row-major ``[Rv, L]``)."""
    verify_write_index: torch.Tensor | None = None
    """``[Nw]``: the grid entries that are real positions (``t < 1 + d``)."""
    verify_write_slots: torch.Tensor | None = None
    """``[Nw]``: the state slot that receives the state after each of those positions
    (block-table column ``t`` of the row; column 0 is the request's own slot)."""
    verify_write_bt_index: torch.Tensor | None = None
    """``[Nw]``: flat block-table index (``row * width + t``) of each written slot
    (``update_block_table`` re-reads ``verify_write_slots`` through it)."""
    prefill_rows: torch.Tensor | None = None
    """``[num_prefills]``: batch rows of the plain prefill rows (``None`` without verifying rows)."""
    prefill_token_index: torch.Tensor | None = None
    """``[num_prefill_tokens]``: their tokens in the flat stream (``None`` without verifying rows)."""


class Mamba2MetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`Mamba2Metadata` for one Mamba cache group.

    Args:
        kv_cache_spec: the group's :class:`~attnplug.cache_groups.specs.MambaSpec`
            (``chunk_size``; ``conv_state_shape[-1]`` is ``conv_kernel_size - 1``).
        layer_names: the group's layers.
        config: buffer limits.
        device: the compute device.

    Raises:
        KVCacheSpecError: a spec without ``chunk_size`` / ``conv_state_shape``.
    """

    cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = 1
    supports_update_block_table = True
    chunks_from_sequence_start = False
    """``False``: chunk boundaries at absolute positions that are multiples of ``chunk_size``
    (Mamba2, as mamba_ssm's chunked scan with initial states); ``True``: each sequence's
    chunks start at its first scheduled token (flash-linear-attention's varlen chunks, GDN)."""

    def __init__(self, kv_cache_spec, layer_names: list[str], config: BuilderConfig,
                 device: torch.device | str):
        super().__init__(kv_cache_spec, layer_names, config, device)
        try:
            self.chunk_size = int(kv_cache_spec.chunk_size)
            self.conv_state_len = int(_conv_state_shape(kv_cache_spec)[-1])
        except (AttributeError, IndexError, TypeError, KVCacheSpecError):
            raise KVCacheSpecError(
                f"Mamba2MetadataBuilder needs a MambaSpec (chunk_size, conv_state_shape), got "
                f"{kv_cache_spec!r}; select a Mamba backend only for 'mamba' cache groups") from None
        if self.chunk_size <= 0:
            raise KVCacheSpecError(f"MambaSpec.chunk_size must be positive, got {self.chunk_size}")
        R, T = config.max_num_reqs, config.max_num_batched_tokens
        K = max_num_chunks(R, T, self.chunk_size)
        d = self.conv_state_len
        self._bound = 2 * R + T + (K + 1) + K + R + K + K * self.chunk_size + T + T + 2 * R * d + T * (d + 1)
        self._index = CpuGpuBuffer((self._bound,), torch.int64, self.device)
        self._state_indices = torch.full((R,), PAD_SLOT_ID, dtype=torch.int32, device=self.device)
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._qsl_p0 = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._qsl_p0_cpu = np.zeros(1, dtype=np.int64)
        self._zero = torch.zeros(1, dtype=torch.int64, device=self.device)  # cu_chunk_seqlen of no chunk
        self.validate_values = switches.flag("ATTNPLUG_VALIDATE")
        """Run every host check on decode steps too (``ATTNPLUG_VALIDATE=1`` when created)."""

    # --- state slots ----------------------------------------------------------------------
    def _view(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``t[start:stop]`` of a persistent buffer, the same view object while the bounds
        repeat (slicing a tensor costs about a microsecond: more than a decode step's arithmetic)."""
        key = (id(t), start, stop)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            view = self._views[key] = t[start:stop]
        return view

    def _state_indices_from(self, block_table: torch.Tensor, num_reqs: int, out: torch.Tensor) -> torch.Tensor:
        if block_table.dim() != 2 or block_table.shape[0] < num_reqs or block_table.shape[1] < 1:
            raise MetadataError(
                f"block_table_tensor has shape {tuple(block_table.shape)} but num_reqs={num_reqs}: a Mamba "
                "group needs one row per request with its state slot in column 0.")
        rows = block_table.shape[0]
        if rows > out.shape[0]:
            raise MetadataError(f"block_table_tensor has {rows} rows but the builder was sized for "
                                f"max_num_reqs={out.shape[0]}; raise max_num_reqs")
        slots = block_table[:, 0] if rows == num_reqs else block_table[:num_reqs, 0]
        self._view(out, 0, num_reqs).copy_(slots)
        if rows > num_reqs:
            out[num_reqs:rows].fill_(PAD_SLOT_ID)
        return self._view(out, 0, rows)

    # --- build ----------------------------------------------------------------------------
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Mamba2Metadata:
        """Build the step's :class:`Mamba2Metadata` (see :class:`AttentionMetadataBuilder`).

        Reads only CPU tensors of ``common_attn_metadata`` (``query_start_loc_cpu``,
        ``num_computed_tokens_cpu``) plus the device block table (state slots copied
        device-side): no device→host synchronisation. One host→device copy of the packed
        index arrays. A step without prefill rows computes no prefill layout at all.

        Raises:
            MetadataError: inconsistent sizes (query_start_loc vs num_reqs /
                num_actual_tokens, a block table without a row per request), or more
                requests/tokens than the builder was sized for.
        """
        cm = common_attn_metadata
        R = cm.num_reqs
        if (cm.num_actual_tokens == R and cm.max_query_len <= 1 and not self.validate_values
                and cm.num_computed_tokens_cpu.shape[0] >= R and R <= self.config.max_num_reqs):
            return self._build_decodes(cm, R)
        return self._build_checked(cm, R)

    def _build_checked(self, cm: CommonAttentionMetadata, R: int, layout_always: bool = False) -> Mamba2Metadata:
        """Every host check, then the decode path (no prefill row, unless ``layout_always``:
        the tests' reference) or the prefill layout."""
        if cm.query_start_loc_cpu.shape[0] < R + 1 or cm.num_computed_tokens_cpu.shape[0] < R:
            raise MetadataError(
                f"query_start_loc_cpu has {cm.query_start_loc_cpu.shape[0]} entries and num_computed_tokens_cpu "
                f"{cm.num_computed_tokens_cpu.shape[0]} but num_reqs={R}: need num_reqs + 1 and num_reqs.")
        qsl = cm.query_start_loc_cpu[:R + 1].numpy().astype(np.int64)
        T = int(qsl[-1]) if R else 0
        if T != cm.num_actual_tokens:
            raise MetadataError(f"query_start_loc_cpu[num_reqs]={T} but num_actual_tokens={cm.num_actual_tokens}: "
                                "they must agree (the flat token count).")
        if R > self.config.max_num_reqs or T > self.config.max_num_batched_tokens:
            raise MetadataError(f"{R} requests / {T} tokens exceed the builder's limits (max_num_reqs="
                                f"{self.config.max_num_reqs}, max_num_batched_tokens={self.config.max_num_batched_tokens})")
        query_lens = np.diff(qsl)
        if (query_lens < 0).any():
            raise MetadataError(f"query_start_loc_cpu {qsl.tolist()} decreases: query lengths must be >= 0")
        not_one = np.flatnonzero(query_lens != 1)
        nd = int(not_one[0]) if not_one.shape[0] else R
        if nd == R and not layout_always:
            return self._build_decodes(cm, R)
        computed = cm.num_computed_tokens_cpu[:R].numpy().astype(np.int64)
        drafts = cm.num_draft_tokens_cpu
        if drafts is not None and bool((drafts[nd:R] > 0).any()):
            return self._build_verifying(cm, R, nd, qsl, computed, drafts[:R].numpy().astype(np.int64))
        starts = np.zeros(R - nd, dtype=np.int64) if self.chunks_from_sequence_start else computed[nd:]
        layout = compute_prefill_layout(query_lens[nd:], starts, self.chunk_size, self.conv_state_len)
        views = self._upload(computed > 0, np.flatnonzero(computed == 0), layout)
        state_indices = self._state_indices_from(cm.block_table_tensor, R, self._state_indices)
        qsl_p = cm.query_start_loc[nd:R + 1] - int(qsl[nd])
        return Mamba2Metadata(
            num_reqs=R, num_actual_tokens=T, num_decodes=nd, num_prefills=R - nd,
            num_decode_tokens=nd, num_prefill_tokens=T - nd, chunk_size=self.chunk_size,
            num_chunks=layout.num_chunks, max_chunks_per_seq=layout.max_chunks_per_seq,
            state_indices=state_indices,
            query_start_loc_p=qsl_p.to(torch.int32), query_start_loc_p_cpu=layout.query_start_loc,
            block_table_tensor=cm.block_table_tensor, **views,
            **{f: getattr(layout, f) for f in _HOST_FIELDS})

    def _build_verifying(self, cm: CommonAttentionMetadata, R: int, nd: int, qsl: np.ndarray,
                         computed: np.ndarray, drafts: np.ndarray) -> Mamba2Metadata:
        """A step with verifying rows (speculative decoding, ``backends/mamba2/verify.py``):
        the plain prefill rows get the chunk layout over their gathered tokens; the
        verifying rows, their grid and state slots (one more host-to-device copy)."""
        bt = cm.block_table_tensor
        ver = compute_verify_layout(qsl, drafts, nd, int(bt.shape[1]))
        prows = ver.prefill_rows
        starts = np.zeros(len(prows), dtype=np.int64) if self.chunks_from_sequence_start else computed[prows]
        layout = compute_prefill_layout(np.diff(qsl)[prows], starts, self.chunk_size, self.conv_state_len)
        views = self._upload(computed > 0, np.flatnonzero(computed == 0), layout)
        state_indices = self._state_indices_from(bt, R, self._state_indices)
        arrays = [ver.verify_rows, ver.verify_token_index, ver.verify_write_index, ver.verify_write_bt_index,
                  prows, ver.prefill_token_index, layout.query_start_loc]
        dev = upload(np.concatenate(arrays), self.device)
        v_rows, v_tok, v_write, v_bt, p_rows, p_tok, qsl_p = torch.split(dev, [a.shape[0] for a in arrays])
        slots = bt.reshape(-1).index_select(0, v_bt).long()
        Tp = int(ver.prefill_token_index.shape[0])
        return Mamba2Metadata(
            num_reqs=R, num_actual_tokens=cm.num_actual_tokens, num_decodes=nd, num_prefills=int(prows.shape[0]),
            num_decode_tokens=nd, num_prefill_tokens=Tp, chunk_size=self.chunk_size,
            num_chunks=layout.num_chunks, max_chunks_per_seq=layout.max_chunks_per_seq,
            state_indices=state_indices, query_start_loc_p=qsl_p.to(torch.int32),
            query_start_loc_p_cpu=layout.query_start_loc, block_table_tensor=bt, **views,
            **{f: getattr(layout, f) for f in _HOST_FIELDS},
            num_verify_rows=int(ver.verify_rows.shape[0]), max_verify_len=ver.max_verify_len,
            verify_rows=v_rows, verify_token_index=v_tok, verify_write_index=v_write, verify_write_slots=slots,
            verify_write_bt_index=v_bt,
            prefill_rows=p_rows, prefill_token_index=p_tok)

    def _build_decodes(self, cm: CommonAttentionMetadata, R: int) -> Mamba2Metadata:
        """A step of one-token rows only (``num_actual_tokens == num_reqs``, ``max_query_len
        <= 1``: host ints): no prefill layout, a constant number of numpy and torch calls."""
        computed_t = cm.num_computed_tokens_cpu
        computed = (computed_t if computed_t.shape[0] == R else computed_t[:R]).numpy()
        fresh = np.flatnonzero(computed == 0)
        F = fresh.shape[0]
        host = self._index.np
        np.greater(computed, 0, out=host[:R], casting="unsafe")
        host[R:R + F] = fresh
        dev = self._index.copy_to_gpu(R + F)
        state_indices = self._state_indices_from(cm.block_table_tensor, R, self._state_indices)
        e, eh = self._empty, _EMPTY_HOST
        return Mamba2Metadata(
            R, R, R, 0, R, 0, self.chunk_size, 0, 0, state_indices, self._view(dev, 0, R) > 0,
            self._view(dev, R, R + F), self._qsl_p0, self._qsl_p0_cpu, eh, _ZERO_HOST, eh, eh, e, e, e, e, e, e, e,
            cm.block_table_tensor)

    def _upload(self, has_initial_state: np.ndarray, fresh_rows: np.ndarray,
                layout: PrefillLayout) -> dict[str, torch.Tensor]:
        """Pack the arrays the impl reads on the device into the persistent host buffer
        (one ``concatenate``), copy once, split into views (one ``split``)."""
        arrays = [has_initial_state, fresh_rows] + [getattr(layout, f) for f in _DEVICE_FIELDS]
        sizes = [a.shape[0] for a in arrays]
        total = sum(sizes)
        assert total <= self._bound, f"index arrays ({total}) exceed the buffer bound ({self._bound})"
        np.concatenate(arrays, out=self._index.np[:total], casting="unsafe")
        parts = torch.split(self._index.copy_to_gpu(total), sizes)
        views = dict(zip(("has_initial_state", "fresh_rows") + _DEVICE_FIELDS, parts))
        views["has_initial_state"] = views["has_initial_state"] > 0
        return views

    def update_block_table(self, metadata: Mamba2Metadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> Mamba2Metadata:
        """A copy of ``metadata`` (built for another group with the same spec) whose state
        slots come from ``block_table``.

        The state indices are *recomputed* from ``block_table`` into this builder's own
        buffer (never the buffer ``metadata`` points at, which another group still reads);
        everything else depends only on the common metadata and is shared.

        Args:
            metadata: built by a builder of this class for a group with the same spec.
            block_table: ``[num_reqs_padded, max_num_blocks_per_req]``, ``torch.int32``,
                device; column 0 holds each row's state slot.
            slot_mapping: ignored (Mamba groups write no paged K/V).

        Raises:
            MetadataError: a block table without a row per request.

        ``metadata`` is not mutated; no host synchronisation.
        """
        out = self._state_indices
        if _shares_storage(metadata.state_indices, out):
            out = torch.full_like(out, PAD_SLOT_ID)
        state_indices = self._state_indices_from(block_table, metadata.num_reqs, out)
        changes = {}
        if metadata.num_verify_rows:  # the scratch slots of the verifying rows, from this group's table
            if block_table.shape[1] != metadata.block_table_tensor.shape[1]:
                raise MetadataError(f"block_table_tensor has {block_table.shape[1]} columns but the metadata was "
                                    f"built with {metadata.block_table_tensor.shape[1]}: equal specs, equal widths")
            changes["verify_write_slots"] = block_table.reshape(-1).index_select(
                0, metadata.verify_write_bt_index).long()
        return dataclasses.replace(metadata, state_indices=state_indices, block_table_tensor=block_table, **changes)


def _conv_state_shape(spec) -> tuple[int, ...]:
    """The declared ``conv_state`` tensor's shape (a ``StateSpec``), else ``spec.conv_state_shape``."""
    tensor = getattr(spec, "tensor", None)
    return tuple(tensor("conv_state").shape) if tensor is not None else tuple(spec.conv_state_shape)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
