"""``CpuSdpaMetadataBuilder``: ``torch_native``'s per-step lowering, with the decodes of mixed
lengths split into length buckets.

``torch_native``'s segments are what the fused kernel wants — every decode in one segment
(one batched call), each multi-token request its own (no query padding), the block ids of
each segment's key range computed once per step on the host for all layers of the group —
except that the one decode segment pads every request's keys to the longest ``seq_len``.
With contexts of 50 and 600 tokens in one batch, most of the gathered keys (and of SDPA's
work) would be padding. So a full-attention decode segment of mixed lengths is split into
:class:`DecodeBucket` segments: the requests sorted by ``seq_len``, longest first, a bucket
closing when the next request is shorter than :data:`BUCKET_RATIO` of the bucket's longest
(every bucket pads its keys by less than ``1 / BUCKET_RATIO``). Each bucket also carries,
computed here once per step for all layers, its key-padding mask and the flat rows of its
gathered keys that no query sees (zeroed by the impl: ``impl.py``).

Where the compiled paged kernel (``paged.py``) takes the group's spec (its dtype and head
size) the buckets are not built: the kernel reads the block table, ``query_start_loc`` and
``seq_lens`` in place, in one call per layer, for every request :func:`kernel_takes` gives
it — decodes, speculative rows and short chunks always; in float32 also every prompt and
chunk whose keys fit :data:`KERNEL_MAX_PREFILL_SEQ_LEN`, and longer continuations at head
size 32 or less — the rest keep their own segment
for SDPA, whose blocked matrix products beat the kernel's per-row dot products there
(measured: docs/performance.md, "Prefill on the paged kernel"). The builder adds what the
kernel needs once per step (:class:`CpuSdpaMetadata`: the requests to attend and the largest
block id they may read, checked against the cache by the impl).

A prompt that stays on SDPA with no earlier context (its keys are exactly this step's
K/V rows: full attention, every row written) becomes a :class:`FreshPrefill` segment: the
impl attends over slices of the step's ``key`` / ``value`` (no gather from the cache, no
mask: ``is_causal``) and writes the output rows as one slice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from attnplug.backends.cpu_sdpa import paged
from attnplug.backends.torch_native.builder import AttentionSegment, TorchNativeMetadata, TorchNativeMetadataBuilder
from attnplug.core.errors import MetadataError

KERNEL_MAX_QUERY_LEN = 8
"""Requests with at most this many query tokens run the paged kernel whatever their dtype
and context (:func:`kernel_takes`)."""

KERNEL_MAX_PREFILL_SEQ_LEN = {torch.float32: 1024}
"""Per dtype: a request with more query tokens than :data:`KERNEL_MAX_QUERY_LEN` still runs
the paged kernel while its ``seq_len`` (context plus query tokens) is at most this. Measured
(docs/performance.md, "Prefill on the paged kernel (issue 38, session 13)", float32, one
thread): the kernel beats both SDPA paths up to 1,024 keys on tiny-llama's (8:2 × 32) and
SmolLM2's (9:3 × 64) shapes, fresh prompts and continuations alike (a fresh 1,024-token
prompt: even); past that SDPA wins on fresh prompts (2,048 tokens: 1.1–1.3×) and on head
size 64's continuations over long contexts (4,096 + 512: 1.5×). In bfloat16 SDPA's blocked
kernels win from 16–64 query tokens on, so bfloat16 / float16 keep the 8-token rule."""

KERNEL_CONTINUATION_MAX_HEAD_SIZE = 32
"""In a dtype of :data:`KERNEL_MAX_PREFILL_SEQ_LEN`, a chunked-prefill continuation (context
> 0) with head size at most this runs the kernel at any ``seq_len``: measured faster than
the gathered SDPA path up to 4,096 + 2,048 tokens at head size 32 (0.59–0.97 of its time)."""


def kernel_takes(query_len: int, seq_len: int, head_size: int, dtype: torch.dtype) -> bool:
    """Whether the paged kernel attends a request of ``query_len`` query tokens and
    ``seq_len`` keys (tokens, context included) in a group of ``head_size`` and ``dtype``
    (the spec's), not SDPA: at most :data:`KERNEL_MAX_QUERY_LEN` query tokens; or, in a
    dtype of :data:`KERNEL_MAX_PREFILL_SEQ_LEN`, ``seq_len`` within its bound, or a
    continuation (``seq_len > query_len``) with head size at most
    :data:`KERNEL_CONTINUATION_MAX_HEAD_SIZE`. Computed by the builder once per step."""
    if query_len <= KERNEL_MAX_QUERY_LEN:
        return True
    bound = KERNEL_MAX_PREFILL_SEQ_LEN.get(dtype)
    if bound is None:
        return False
    return seq_len <= bound or (seq_len > query_len and head_size <= KERNEL_CONTINUATION_MAX_HEAD_SIZE)


BUCKET_RATIO = 0.5
"""A decode bucket takes the next (shorter) request while its ``seq_len`` is at least this
share of the bucket's longest: padding stays under a third of a bucket's keys, and the
number of buckets under ``log(max / min) / log(1 / BUCKET_RATIO) + 1`` (each bucket costs
one gather and one SDPA call per layer)."""


@dataclass(frozen=True)
class DecodeBucket(AttentionSegment):
    """A full-attention decode segment of similar lengths (module docstring); the fields of
    :class:`AttentionSegment` (``query_len`` 1, ``key_offsets`` 0, ``key_block_columns`` /
    ``key_block_live`` set, ``row_start`` ``None``) plus:"""

    key_mask: torch.Tensor | None = None
    """``[n, 1, 1, max_seq_len]`` bool: key column ``j`` of request ``r`` is visible
    (``j < seq_lens[r]``)."""

    hidden_rows: torch.Tensor | None = None
    """``[h]`` int64: rows of the gathered ``[n * num_key_blocks * block_size]`` keys past
    their request's ``seq_len`` and below ``max_seq_len`` (zeroed before SDPA: ``-inf`` plus
    a poisoned value would still be NaN)."""


@dataclass(frozen=True)
class FreshPrefill(AttentionSegment):
    """A prompt with no earlier context on the SDPA path (module docstring): one request
    (``n`` = 1, ``row_start`` set, ``query_len == max_seq_len``, ``key_offsets`` 0), the
    fields of :class:`AttentionSegment` (any path may still run it as one) plus:"""

    token_start: int = 0
    """Its first row of the flat token stream (``query_start_loc[row_start]``): its query,
    key, value and output rows are ``token_start .. token_start + query_len - 1``."""


def bucket_bounds(seq_sorted: np.ndarray, ratio: float = BUCKET_RATIO) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` (end exclusive) of the buckets of ``seq_sorted`` (``seq_lens``
    in descending order): a bucket ends before the first length below ``ratio`` times its
    first (longest)."""
    bounds, start, n = [], 0, seq_sorted.shape[0]
    while start < n:
        cut = ratio * float(seq_sorted[start])
        end = start + int(np.searchsorted(-seq_sorted[start:], -cut, side="right"))
        end = max(end, start + 1)
        bounds.append((start, end))
        start = end
    return bounds


def split_decodes(seg: AttentionSegment, block_size: int) -> list[AttentionSegment]:
    """``seg`` (a full-attention decode segment of mixed lengths) as :class:`DecodeBucket`
    segments, longest first; ``[seg]`` when it would be one bucket."""
    seq = seg.seq_lens.cpu().numpy()
    order = np.argsort(-seq, kind="stable")
    bounds = bucket_bounds(seq[order])
    if len(bounds) == 1:
        return [seg]
    device = seg.seq_lens.device
    buckets = []
    for start, end in bounds:
        rows = order[start:end]
        longest, shortest = int(seq[rows[0]]), int(seq[rows[-1]])
        nkb = -(-longest // block_size)
        idx = torch.from_numpy(rows).to(device)
        lens = seq[rows]
        cols = np.arange(nkb, dtype=np.int64)
        live_np = cols[None, :] < ((lens + block_size - 1) // block_size)[:, None]
        width = nkb * block_size
        visible = np.arange(longest)[None, :] < lens[:, None]  # [n, longest]
        r, c = np.nonzero(~visible)
        buckets.append(DecodeBucket(
            req_indices=seg.req_indices.index_select(0, idx), query_len=1, max_seq_len=longest,
            min_seq_len=shortest, query_token_indices=seg.query_token_indices.index_select(0, idx),
            query_positions=seg.query_positions.index_select(0, idx), seq_lens=seg.seq_lens.index_select(0, idx),
            key_block_ids=seg.key_block_ids.index_select(0, idx)[:, :nkb].long(),
            key_offsets=seg.key_offsets.index_select(0, idx), min_key_offset=0, max_key_offset=0,
            key_block_columns=torch.from_numpy(np.where(live_np, cols[None, :], 0)).to(device),
            key_block_live=torch.from_numpy(live_np).to(device), row_start=None,
            key_mask=torch.from_numpy(visible).to(device).view(len(rows), 1, 1, longest),
            hidden_rows=torch.from_numpy(r * width + c).to(device)))
    return buckets


@dataclass(frozen=True)
class CpuSdpaMetadata(TorchNativeMetadata):
    """``torch_native``'s metadata (every field, the same meaning) plus, when the paged
    kernel takes the group, what it reads once per step:"""

    paged_reqs: torch.Tensor | None = None
    """``[n]``, ``torch.int64``, contiguous: the requests the kernel attends, those with at
    most ``KERNEL_MAX_QUERY_LEN`` query tokens; ``None`` when the layers run the SDPA path
    (then ``segments`` carry the decodes in buckets). ``segments`` always covers every
    request (``torch_native``'s, for a layer the kernel does not take)."""

    sdpa_segments: tuple[AttentionSegment, ...] = ()
    """With ``paged_reqs``: the segments of ``segments`` that :func:`kernel_takes` leaves to
    SDPA (their :class:`FreshPrefill` ones included), which run next to the kernel."""

    paged_all_reqs: torch.Tensor | None = None
    """``[num_reqs]``, ``torch.int64``: every request, for a layer that runs the kernel on
    all rows (a soft-capped layer: SDPA has no soft-cap); set with ``paged_reqs``."""

    max_block_id: int = -1
    """The largest block id in the first ``num_reqs`` rows of ``block_table_tensor`` (the
    impl checks it against ``kv_cache.shape[0]`` before the kernel reads raw memory)."""

    write_slot_range: tuple[int, int] = (0, -1)
    """``(min, max)`` of ``write_slots`` (flat slots; ``(0, -1)`` when there are none): the
    impl checks them against the cache's slots before the K/V write (a negative slot would
    wrap to the cache's last blocks, one past it is torch's ``IndexError``)."""


class CpuSdpaMetadataBuilder(TorchNativeMetadataBuilder):
    """Builds :class:`CpuSdpaMetadata` (see ``torch_native``'s builder: same fields, same
    cascade and ``update_block_table`` support): for the paged kernel when it takes the
    group's spec (module docstring), else with the full-attention decodes of mixed lengths
    as :class:`DecodeBucket` segments."""

    paged_kernel = True
    """Build for the compiled kernel where it takes the spec (``False``: always the SDPA
    path's buckets; ``CpuSdpaGatherBackend`` and the tests of that path set it)."""

    def _use_kernel(self, causal: bool) -> bool:
        spec = self.kv_cache_spec
        return self.paged_kernel and paged.unsupported(spec.dtype, spec.dtype, spec.head_size, causal,
                                                       self.sliding_window) is None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CpuSdpaMetadata:
        """``torch_native``'s build (same arguments, errors and host synchronisation), then
        the kernel's fields or the decode buckets (module docstring).

        Raises ``MetadataError`` (besides ``torch_native``'s) when a request's ``seq_len``
        needs more block-table columns than the table has."""
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md = CpuSdpaMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)})
        if md.cascade is not None:
            return md
        if self._use_kernel(md.causal) and _kernel_layout(md.block_table_tensor, md.query_start_loc, md.seq_lens):
            return self._with_kernel_fields(md, md.block_table_tensor)
        if self.sliding_window is not None:
            return md
        segments: list[AttentionSegment] = []
        for seg in md.segments:
            if seg.query_len == 1 and seg.min_seq_len != seg.max_seq_len:
                segments += split_decodes(seg, self.block_size)
            else:
                segments.append(seg)
        return dataclasses.replace(md, segments=self._fresh(md, segments))

    def _fresh(self, md: CpuSdpaMetadata, segments) -> tuple[AttentionSegment, ...]:
        """``segments`` with each prompt that has no earlier context as a
        :class:`FreshPrefill` (module docstring): full attention, a one-request segment whose
        keys are its own query tokens, every token row of the step written (no
        ``PAD_SLOT_ID``: the cache then holds exactly the step's K/V for it)."""
        if self.sliding_window is not None or md.write_token_indices.shape[0] != md.num_actual_tokens:
            return tuple(segments)
        starts = None
        out = []
        for seg in segments:
            if seg.row_start is not None and seg.query_len > 1 and seg.query_len == seg.max_seq_len \
                    and seg.max_key_offset == 0:
                if starts is None:
                    starts = md.query_start_loc.cpu().tolist()
                seg = FreshPrefill(**{f.name: getattr(seg, f.name) for f in dataclasses.fields(seg)},
                                   token_start=int(starts[seg.row_start]))
            out.append(seg)
        return tuple(out)

    def update_block_table(self, metadata: CpuSdpaMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> CpuSdpaMetadata:
        """``torch_native``'s (same arguments and errors), the kernel's fields read anew
        from ``block_table``."""
        md = super().update_block_table(metadata, block_table, slot_mapping)
        if md.paged_reqs is None:
            return md
        if not _kernel_layout(block_table, md.query_start_loc, md.seq_lens):
            raise MetadataError(f"cpu_sdpa update_block_table: block_table {block_table.dtype} with strides "
                                f"{block_table.stride()}: the paged kernel reads int32 rows with a contiguous last dim")
        return self._with_kernel_fields(md, block_table)

    def _with_kernel_fields(self, md: CpuSdpaMetadata, block_table: torch.Tensor) -> CpuSdpaMetadata:
        n = md.num_reqs
        if md.max_seq_len > block_table.shape[1] * self.block_size:
            raise MetadataError(f"cpu_sdpa build: max_seq_len={md.max_seq_len} needs "
                                f"{-(-md.max_seq_len // self.block_size)} block-table columns, the table has "
                                f"{block_table.shape[1]}")
        spec = self.kv_cache_spec
        short, long = [], []
        for seg in md.segments:  # decodes: one segment, query_len 1; every longer request its own
            (short if kernel_takes(seg.query_len, seg.max_seq_len, spec.head_size, spec.dtype) else long).append(seg)
        reqs = torch.cat([seg.req_indices for seg in short]) if short \
            else torch.zeros(0, dtype=torch.int64, device=block_table.device)
        return dataclasses.replace(md, sdpa_segments=self._fresh(md, long), paged_reqs=reqs.to(torch.int64).contiguous(),
                                   paged_all_reqs=torch.arange(n, dtype=torch.int64, device=block_table.device),
                                   max_block_id=int(block_table[:n].max()) if n else -1,
                                   write_slot_range=(int(md.write_slots.min()), int(md.write_slots.max()))
                                   if md.write_slots.numel() else (0, -1))


class CpuSdpaGatherMetadataBuilder(CpuSdpaMetadataBuilder):
    """The SDPA path's metadata (decode buckets) whatever the spec (``CpuSdpaGatherBackend``)."""

    paged_kernel = False


def _kernel_layout(block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """The step's tensors are as the kernel reads them in place: int32 on the CPU, the block
    table's rows with a contiguous last dim, ``query_start_loc`` and ``seq_lens`` contiguous
    (the engine's always are; otherwise the builder falls back to the SDPA path's buckets)."""
    return (block_table.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int32
            and block_table.device.type == "cpu" and block_table.stride(-1) == 1
            and query_start_loc.is_contiguous() and seq_lens.is_contiguous())


__all__ = ["BUCKET_RATIO", "KERNEL_CONTINUATION_MAX_HEAD_SIZE", "KERNEL_MAX_PREFILL_SEQ_LEN", "KERNEL_MAX_QUERY_LEN",
           "CpuSdpaGatherMetadataBuilder",
           "CpuSdpaMetadata", "CpuSdpaMetadataBuilder", "DecodeBucket", "FreshPrefill", "bucket_bounds",
           "kernel_takes", "split_decodes"]
