"""``CpuSdpaAttentionImpl``: the compiled paged kernel, else SDPA on gathered blocks.

Per layer: write this step's K/V at the slot mapping (on the kernel's path by the C copy
of ``kv_write.py`` where it takes the tensors), then

* **the paged kernel** (``paged.py``, when it was built and takes the layer: float32 /
  bfloat16 / float16 with the cache in the same dtype, head size a multiple of 8 up to
  256; soft-cap and sliding window included): one call for the query rows of every
  request the builder's ``kernel_takes`` gives it (the metadata's ``paged_reqs``: decodes
  and short chunks, in float32 prompts up to 1,024 keys too; a soft-capped layer: every
  request), reading K/V in place through the block table; the other prompts then run the
  SDPA path below, one segment each;
* **otherwise the SDPA path**, for each segment of the ``torch_native`` metadata (all
  decodes together, in length buckets; each prefill alone). A prompt with no earlier
  context (the builder's ``FreshPrefill``: its keys are exactly this step's K/V rows) and
  a cache in the step's dtype: one SDPA call over slices of ``query`` / ``key`` / ``value``
  (``is_causal``, ``enable_gqa``; nothing gathered, no mask), the output written as one
  slice of rows. Every other segment:

1. gather the segment's key blocks once (``index_select`` of whole blocks, K and V), cut
   to the key columns some query sees;
2. call ``torch.nn.functional.scaled_dot_product_attention`` (CPU: the fused flash kernel,
   online softmax in float32, no ``[T, S]`` logits temporary) with the least mask the
   segment needs:

   * decodes of one context length, full attention: no mask at all; decodes of mixed
     lengths: a ``[n, 1, 1, S]`` key-padding mask (one byte per key, not per logit), for
     full attention one per length bucket (``builder.py``'s ``DecodeBucket``: its mask and
     hidden rows are built once per step by the builder);
   * a prefill with no earlier context: ``is_causal=True`` (top-left = bottom-right);
   * a chunked-prefill continuation or a sliding window: the bottom-right causal /
     window mask of ``torch_native.attention.visibility_mask``, ``[n, 1, L, S]`` bool.

   Decode GQA/MQA stacks the ``group`` query heads of a KV head as query rows
   (``[n, H_kv, group, D]``), so K/V are never expanded; prefill GQA uses SDPA's
   ``enable_gqa``.

Keys no query sees (past a request's ``seq_len`` in a mixed-length decode segment, before
a window) are zeroed in the gathered copy, K and V: SDPA adds ``-inf`` to masked logits,
and ``-inf + NaN`` (a poisoned or recycled block) would still be NaN.

A cascade step runs the ``torch_native`` path
(:class:`~attnplug.backends.torch_native.impl.TorchNativeAttentionImpl`, which this class
extends: the cascade merge needs each pass's log-sum-exp), and so do a layer with a
logits soft-cap off the kernel (SDPA has no soft-cap) and a layer with attention sinks or
ALiBi slopes (neither the kernel nor SDPA adds them), every step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from attnplug.backends.common.kv_scales import kv_scales_for
from attnplug.backends.torch_native.attention import keys_used, visibility_mask, write_to_paged_cache
from attnplug.backends.torch_native.builder import AttentionSegment, TorchNativeMetadata
from attnplug.backends.torch_native.impl import TorchNativeAttentionImpl
from attnplug.backends.cpu_sdpa import kv_write, paged
from attnplug.backends.cpu_sdpa.builder import DecodeBucket, FreshPrefill
from attnplug.core import switches
from attnplug.core.contracts import AttentionType
from attnplug.core.errors import MetadataError
from attnplug.core.kv_quant import dequantize_kv, is_quantized


class CpuSdpaAttentionImpl(TorchNativeAttentionImpl):
    """One layer's attention through the fused SDPA kernel (see the module docstring).

    ``CpuSdpaAttentionImpl(num_heads, head_size, scale, num_kv_heads, sliding_window=None,
    logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_cache_dtype=None, sinks=None,
    alibi_slopes=None)``; the arguments, errors and the KV-cache layout are ``torch_native``'s
    (a layer with ``sinks`` or ``alibi_slopes`` runs its path).

    Examples:
        >>> import torch
        >>> from attnplug.backends.cpu_sdpa import CpuSdpaBackend
        >>> from attnplug.cache_groups.specs import FullAttentionSpec
        >>> from attnplug.core import BuilderConfig, CommonAttentionMetadata
        >>> spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8)
        >>> builder = CpuSdpaBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(2, 16, 16), "cpu")
        >>> cm = CommonAttentionMetadata.from_lengths([0, 3], [3, 1], [[1, 0], [2, 0]], block_size=4)
        >>> impl = CpuSdpaBackend.get_impl_cls()(2, 8, 8 ** -0.5, 1)
        >>> kv_cache = torch.zeros(CpuSdpaBackend.get_kv_cache_shape(3, 4, 1, 8))
        >>> q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
        >>> impl.forward(None, q, k, v, kv_cache, builder.build(0, cm), torch.zeros(4, 2, 8)).shape
        torch.Size([4, 2, 8])
    """

    paged_kernel = True
    """Run the compiled paged kernel where it takes the call (``False``: always the SDPA
    path; ``CpuSdpaGatherBackend`` and the tests of that path set it)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 attn_type: AttentionType = AttentionType.DECODER,
                 kv_cache_dtype: torch.dtype | None = None, sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None):
        # The signature is pinned here, not inherited: a feature the reference impl gains
        # later must not reach this fast path unnoticed. Sinks and ALiBi slopes are taken,
        # and a layer with either runs the reference path (``forward``).
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap, attn_type,
                         kv_cache_dtype, sinks, alibi_slopes)
        self._kernel_ok: dict[tuple, bool] = {}
        self._validate_every_layer = switches.flag("ATTNPLUG_VALIDATE")
        """``ATTNPLUG_VALIDATE=1``: the kernel path's checks on every layer, not once per step
        and geometry (:meth:`_checked`)."""

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TorchNativeMetadata,
                output: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V at the slot mapping, then attend over the paged cache.

        Args, returns and errors: those of ``TorchNativeAttentionImpl.forward`` (query
        ``[num_tokens, num_heads, head_size]``, key/value ``[num_tokens, num_kv_heads,
        head_size]``, kv_cache ``[num_blocks, 2, block_size, num_kv_heads, head_size]``,
        output ``[num_tokens, num_heads, head_size]`` written in place for the real rows).

        Numerics: the paged kernel and SDPA's CPU kernel both accumulate logits, softmax
        and the weighted sum in float32 for every input dtype; on the SDPA path K/V are
        cast to ``query.dtype`` when the cache holds another dtype.

        Raises (besides ``torch_native``'s): ``MetadataError`` when the metadata's block
        table names a block past ``kv_cache`` or ``slot_mapping`` a slot outside it (the
        kernel's metadata), or (the kernel's rows) a block id, length or
        ``query_start_loc`` the tensors cannot hold (``paged.check_metadata``, before the
        K/V write: the kernel reads raw memory).
        """
        md = attn_metadata
        if self.sinks is not None or self.alibi_slopes is not None:  # neither kernel has them: the reference
            return super().forward(layer, query, key, value, kv_cache, md, output)
        if getattr(md, "cascade", None) is None and getattr(md, "paged_reqs", None) is not None \
                and self._kernel_takes(query, kv_cache, md.causal):
            return self._forward_paged(query, key, value, kv_cache, md, output)
        if self.logits_soft_cap is not None or getattr(md, "cascade", None) is not None:
            return super().forward(layer, query, key, value, kv_cache, md, output)
        self._check(query, key, value, kv_cache, md, output)
        scales = kv_scales_for(layer, self.num_kv_heads, kv_cache.dtype, "cpu_sdpa forward")
        self._check_write_slots(md, kv_cache, "cpu_sdpa forward")
        write_to_paged_cache(key, value, kv_cache, md.write_slots, md.write_token_indices, *scales)
        for seg in md.segments:
            self._attend_into(output, query, key, value, kv_cache, md, seg, scales)
        return output

    def _attend_into(self, output: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     kv_cache: torch.Tensor, md: TorchNativeMetadata, seg: AttentionSegment,
                     scales=(None, None)) -> None:
        """One SDPA-path segment's rows of ``output``: a :class:`FreshPrefill` over slices of
        the step's K/V when the cache holds them unchanged (not quantised), else gathered from
        the cache (``_attend_segment``) and written by index."""
        if isinstance(seg, FreshPrefill) and not is_quantized(kv_cache.dtype):
            a, b = seg.token_start, seg.token_start + seg.query_len
            output[a:b] = self._attend_fresh(query[a:b], key[a:b], value[a:b], kv_cache.dtype, md.causal)
            return
        out = self._attend_segment(query, kv_cache, md, seg, scales)  # [n * query_len, num_heads, head_size]
        output[seg.query_token_indices.flatten()] = out.to(output.dtype)

    def _attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype,
                      causal: bool) -> torch.Tensor:
        """``[L, num_heads, head_size]`` in ``q.dtype``: ``q`` ``[L, num_heads, head_size]``
        attending ``k`` / ``v`` ``[L, num_kv_heads, head_size]`` (one prompt's rows, its only
        keys) causally (``causal``), K/V rounded through ``cache_dtype`` first so they equal
        what the cache holds (a no-op when it is theirs)."""
        k, v = k.to(cache_dtype).to(q.dtype), v.to(cache_dtype).to(q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                             v.transpose(0, 1).unsqueeze(0), is_causal=causal, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out[0].transpose(0, 1)

    def _forward_paged(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       md, output: torch.Tensor) -> torch.Tensor:
        """``forward`` on the kernel's metadata (``md.paged_reqs`` set): checks (:meth:`_checked`),
        the K/V write, one kernel call for the rows of ``md.paged_reqs`` (every row on a
        soft-capped layer), SDPA for each of ``md.sdpa_segments``."""
        capped = self.logits_soft_cap is not None  # SDPA has no soft-cap: every row on the kernel
        reqs = md.paged_all_reqs if capped else md.paged_reqs
        c_write = self._checked(query, key, value, kv_cache, md, output, reqs)
        if not c_write:  # the C copy does not take these tensors: the torch write
            write_to_paged_cache(key, value, kv_cache, md.write_slots, md.write_token_indices)
        else:  # slots and token indices checked in C before the copy
            kv_write.write_taken(key, value, kv_cache, md.write_slots, md.write_token_indices)
        if reqs.shape[0]:  # the metadata's values checked in C before any read
            paged.paged_attention_checked(output, query, kv_cache, md.block_table_tensor, md.query_start_loc,
                                          md.seq_lens, reqs, scale=self.scale, sliding_window=self.sliding_window,
                                          logits_soft_cap=self.logits_soft_cap, causal=md.causal)
        for seg in () if capped else md.sdpa_segments:  # the prompts kernel_takes leaves: SDPA
            self._attend_into(output, query, key, value, kv_cache, md, seg)
        return output

    def _checked(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, md,
                 output: torch.Tensor, reqs: torch.Tensor) -> bool:
        """:meth:`_forward_paged`'s checks, before anything is written; returns whether the C
        K/V copy takes the tensors (``kv_write.takes``).

        The checks — ``torch_native``'s of the tensors against the layer and the metadata,
        the block table's largest id and the written slots against ``kv_cache``, the
        kernel's rows (``paged.check_metadata``) and the kernel's tensor layouts
        (``paged.check_call``) — depend only on the metadata object, the layer's
        attention parameters and the tensors' dtypes, devices, shapes and strides. They run
        for the first layer of a step with a given combination of those; the layers after it
        with the same combination reuse the outcome, remembered on the metadata object
        (``md.__dict__``: it lives for one step). With ``ATTNPLUG_VALIDATE=1`` (read at
        construction) every layer runs them. What the C code reads or writes (block ids,
        lengths, ``query_start_loc``, slots, token indices) is checked in C on every call."""
        memo = None
        if not self._validate_every_layer:
            sig = (self.num_heads, self.num_kv_heads, self.head_size, self.sliding_window, self.logits_soft_cap,
                   query.dtype, query.device, query.shape, query.stride(), key.dtype, key.device, key.shape,
                   key.stride(), value.dtype, value.device, value.shape, value.stride(), output.dtype,
                   output.device, output.shape, output.stride(), kv_cache.dtype, kv_cache.device, kv_cache.shape,
                   kv_cache.stride())
            memo = md.__dict__.get("_cpu_sdpa_checked")
            if memo is None:
                memo = md.__dict__["_cpu_sdpa_checked"] = {}
            hit = memo.get(sig)
            if hit is not None:
                return hit
        self._check(query, key, value, kv_cache, md, output)
        if md.max_block_id >= kv_cache.shape[0]:
            raise MetadataError(f"cpu_sdpa forward: the block table names block {md.max_block_id}, the KV cache "
                                f"has {kv_cache.shape[0]} blocks")
        lo, hi = md.write_slot_range
        if lo < 0 or hi >= kv_cache.shape[0] * kv_cache.shape[2]:
            raise MetadataError(f"cpu_sdpa forward: slot_mapping holds slot {lo if lo < 0 else hi}, outside the KV "
                                f"cache's {kv_cache.shape[0] * kv_cache.shape[2]} slots; the cache is unchanged")
        if reqs.shape[0]:  # before the write: bad metadata changes nothing
            paged.check_metadata(query.shape[0], kv_cache, md.block_table_tensor, md.query_start_loc, md.seq_lens,
                                 reqs, sliding_window=self.sliding_window, causal=md.causal)
            paged.check_call(output, query, kv_cache, md.block_table_tensor, md.query_start_loc, md.seq_lens, reqs,
                             sliding_window=self.sliding_window, causal=md.causal,
                             logits_soft_cap=self.logits_soft_cap)
        c_write = kv_write.takes(key, value, kv_cache, md.write_slots, md.write_token_indices)
        if memo is not None:
            memo[sig] = c_write
        return c_write

    def _kernel_takes(self, query: torch.Tensor, kv_cache: torch.Tensor, causal: bool) -> bool:
        """The paged kernel runs this call (``paged_kernel`` on, ``paged.unsupported`` says
        nothing; remembered per dtype pair)."""
        if not self.paged_kernel:
            return False
        key = (query.dtype, kv_cache.dtype, causal, query.device.type)
        ok = self._kernel_ok.get(key)
        if ok is None:
            ok = self._kernel_ok[key] = query.device.type == "cpu" and paged.unsupported(
                query.dtype, kv_cache.dtype, self.head_size, causal, self.sliding_window) is None
        return ok

    def _attend_segment(self, query: torch.Tensor, kv_cache: torch.Tensor, md: TorchNativeMetadata,
                        seg: AttentionSegment, scales=(None, None)) -> torch.Tensor:
        """``[n * query_len, num_heads, head_size]`` in ``query.dtype``: the segment's
        outputs, request-major. ``scales``: an fp8 cache's ``(k_scale, v_scale)``."""
        if isinstance(seg, DecodeBucket):
            return self._attend_bucket(query, kv_cache, seg, md.block_size, scales)
        n, q_len = seg.query_token_indices.shape
        k_lo, k_hi = self._key_columns(seg, md.block_size)
        keys, values = self._gather(kv_cache, seg, md.block_size, k_lo, k_hi, query.dtype, scales)  # [n,H_kv,S,D]
        mask, is_causal = self._mask(seg, md, k_lo, k_hi)
        if mask is not None and (seg.min_seq_len != seg.max_seq_len or self.sliding_window is not None
                                 or seg.min_key_offset != seg.max_key_offset):
            used = keys_used(seg.seq_lens, q_len, seg.key_block_ids.shape[1] * md.block_size,
                             self.sliding_window, seg.key_offsets if seg.max_key_offset else None)
            hidden = ~used[:, k_lo:k_hi].view(n, 1, -1, 1)  # against [n, H_kv, S, D]
            keys.masked_fill_(hidden, 0.0)
            values.masked_fill_(hidden, 0.0)
        q = query[seg.query_token_indices]  # [n, q_len, num_heads, head_size]
        if q_len == 1:  # the group's query heads as rows: [n, H_kv, group, D]; K/V never expanded
            q = q.view(n, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
            return out.reshape(n, self.num_heads, self.head_size)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                             attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(n * q_len, self.num_heads, self.head_size)

    def _attend_bucket(self, query: torch.Tensor, kv_cache: torch.Tensor, seg: DecodeBucket,
                       block_size: int, scales=(None, None)) -> torch.Tensor:
        """A decode bucket (``builder.py``): gather (an fp8 cache dequantised, ``stored *
        scale`` per KV head), zero the rows no query sees (their flat indices and the
        key-padding mask come from the builder, once per step), one SDPA call.
        ``[n, num_heads, head_size]`` in ``query.dtype``."""
        n = seg.query_token_indices.shape[0]
        flat = seg.key_block_ids.flatten()
        rows = flat.shape[0] * block_size
        keys = kv_cache[:, 0].index_select(0, flat).view(rows, self.num_kv_heads, self.head_size)
        values = kv_cache[:, 1].index_select(0, flat).view(rows, self.num_kv_heads, self.head_size)
        if is_quantized(kv_cache.dtype):
            keys, values = dequantize_kv(keys, scales[0], query.dtype), dequantize_kv(values, scales[1], query.dtype)
        if seg.hidden_rows.shape[0]:
            keys.index_fill_(0, seg.hidden_rows, 0.0)
            values.index_fill_(0, seg.hidden_rows, 0.0)
        shape = (n, rows // n, self.num_kv_heads, self.head_size)
        keys = keys.view(shape)[:, :seg.max_seq_len].to(query.dtype).transpose(1, 2)
        values = values.view(shape)[:, :seg.max_seq_len].to(query.dtype).transpose(1, 2)
        q = query[seg.query_token_indices.flatten()].view(n, self.num_kv_heads, self.num_heads // self.num_kv_heads,
                                                          self.head_size)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seg.key_mask, scale=self.scale)
        return out.reshape(n, self.num_heads, self.head_size)

    def _key_columns(self, seg: AttentionSegment, block_size: int) -> tuple[int, int]:
        """Key columns ``k_lo .. k_hi - 1`` (end exclusive) that some query of the segment
        sees: none past ``max_seq_len``, none before the earliest window start (column
        ``j`` of request ``r`` is position ``key_offsets[r] + j``)."""
        num_cols = seg.key_block_ids.shape[1] * block_size
        k_hi = min(num_cols, seg.max_seq_len - seg.min_key_offset)
        k_lo = 0
        if self.sliding_window is not None:
            k_lo = max(0, seg.min_seq_len - seg.query_len - self.sliding_window + 1 - seg.max_key_offset)
        return k_lo, max(k_hi, k_lo + 1)

    def _gather(self, kv_cache: torch.Tensor, seg: AttentionSegment, block_size: int, k_lo: int, k_hi: int,
                dtype: torch.dtype, scales=(None, None)) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)``, each ``[n, num_kv_heads, k_hi - k_lo, head_size]`` in ``dtype``:
        strided views of one fresh whole-block ``index_select`` copy per K and V (an fp8
        cache: dequantised, ``stored * scale`` per KV head, ``core/kv_quant.py``).

        Whole blocks (``block_size * H_kv * D`` contiguous elements each) are gathered and
        the head axis is moved by a view, not a copy: measured on the decode shapes of
        ``attnplug bench attention``, a per-token gather straight into ``[H_kv, n, S, D]``
        is ~10x slower than this, and SDPA's CPU kernel reads the strided view at speed."""
        n = seg.key_block_ids.shape[0]
        flat = seg.key_block_ids.flatten()
        shape = (n, seg.key_block_ids.shape[1] * block_size, self.num_kv_heads, self.head_size)
        keys = kv_cache[:, 0].index_select(0, flat).view(shape)[:, k_lo:k_hi]
        values = kv_cache[:, 1].index_select(0, flat).view(shape)[:, k_lo:k_hi]
        if is_quantized(kv_cache.dtype):
            keys, values = dequantize_kv(keys, scales[0], dtype), dequantize_kv(values, scales[1], dtype)
        return keys.to(dtype).transpose(1, 2), values.to(dtype).transpose(1, 2)

    def _mask(self, seg: AttentionSegment, md: TorchNativeMetadata, k_lo: int,
              k_hi: int) -> tuple[torch.Tensor | None, bool]:
        """``(attn_mask, is_causal)`` for SDPA: the least the segment needs (module
        docstring). ``attn_mask`` is ``[n, 1, query_len, S]`` bool (True = visible) or
        ``None``."""
        offsets = seg.key_offsets if seg.max_key_offset else None
        uniform = seg.min_seq_len == seg.max_seq_len and seg.min_key_offset == seg.max_key_offset
        if self.sliding_window is None and uniform:
            if seg.query_len == 1 or not md.causal:
                return None, False
            if seg.max_seq_len == seg.query_len and k_lo == 0:
                return None, True
        mask = visibility_mask(seg.query_positions, seg.seq_lens, k_lo, k_hi, causal=md.causal,
                               sliding_window=self.sliding_window, key_offsets=offsets)
        return mask.unsqueeze(1), False


class CpuSdpaGatherAttentionImpl(CpuSdpaAttentionImpl):
    """The SDPA path for every call (``CpuSdpaGatherBackend``)."""

    paged_kernel = False
