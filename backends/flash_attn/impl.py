"""``FlashAttnImpl``: write this step's K/V, then call the FlashAttention kernel.

FlashAttention 2: ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=, causal=, window_size=,
softcap=, block_table=)``. FlashAttention 3: ``flash_attn_with_kvcache(q, k_cache,
v_cache, cache_seqlens=, page_table=, cu_seqlens_q=, max_seqlen_q=, softmax_scale=,
causal=, window_size=, softcap=, scheduler_metadata=)``. ``k_cache``/``v_cache`` are the
two halves of the layer's cache (``FlashAttnBackend.split_kv_cache``). There is no
fallback: without the kernels the impl cannot be created.

fp8 KV cache (FA3 only, ``float8_e4m3fn``): K/V are written ``saturate(x / scale)`` with the
layer's ``k_scale`` / ``v_scale`` (``core/kv_quant.py``), the query is quantized the same way
with ``layer.q_scale`` (FA3 takes q, k and v in one dtype), and each call passes
``q_descale`` / ``k_descale`` / ``v_descale``: float32 ``[batch_size, num_kv_heads]`` (the
scales per KV head, expanded over the call's requests), FA3's documented fp8 arguments.
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.backends.common.cache_write import write_kv_by_slot
from attnplug.backends.common.shape_checks import qkv_shape_problems
from attnplug.backends.common.merge import merge_attn_states
from attnplug.backends.common.value_checks import check_batch, check_slots, values_checked
from attnplug.backends.common.window import fa_window_size
from attnplug.backends.flash_attn.kernels import LIVE_LAYER_PARAMS, FlashAttnKernels, installed_kernels
from attnplug.backends.flash_attn.metadata import FlashAttnMetadata
from attnplug.backends.common.kv_scales import kv_scales_for
from attnplug.core.contracts import AttentionImpl, AttentionType
from attnplug.core.errors import BackendUnsupportedError, MetadataError
from attnplug.core.kv_quant import is_quantized, kv_cache_dtype_name, layer_q_scale, per_head_scales, \
    quantize_query, scale_problems


class FlashAttnImpl(AttentionImpl):
    """The attention of one layer with FlashAttention (see the module docstring).

    ``FlashAttnImpl(num_heads, head_size, scale, num_kv_heads, sliding_window=None,
    logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_cache_dtype=None, sinks=None)``.

    Raises:
        BackendUnsupportedError: flash-attn is not installed, ``num_heads`` not a multiple
            of ``num_kv_heads``, a non-positive window or cap, a non-decoder type, or
            ``sinks`` given: FlashAttention 2/3's documented entry points
            (``flash_attn_varlen_func``, ``flash_attn_with_kvcache``) take no sink argument,
            so sinks are refused, never dropped (``supports_sink()`` is False).
    """

    backend_name = "flash_attn"

    @classmethod
    def load_kernels(cls) -> FlashAttnKernels:
        """The kernels this impl calls (installed flash-attn; the emulators override this).

        Raises:
            BackendUnsupportedError: flash-attn is not installed.
        """
        kernels = installed_kernels()
        if kernels is None:
            from attnplug.backends.flash_attn.kernels import unavailable_reason
            raise BackendUnsupportedError(cls.backend_name, [unavailable_reason() or "flash-attn unavailable"],
                                          context="FlashAttnImpl")
        return kernels

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 attn_type: AttentionType = AttentionType.DECODER,
                 kv_cache_dtype: torch.dtype | None = None, sinks: torch.Tensor | None = None):
        reasons = self.decoder_argument_problems(num_heads, num_kv_heads, sliding_window, logits_soft_cap,
                                                 attn_type)
        if sinks is not None:
            reasons.append("attention sinks not supported: FlashAttention 2/3's flash_attn_varlen_func and "
                           "flash_attn_with_kvcache take no sink argument")
        if reasons:
            raise BackendUnsupportedError(self.backend_name, reasons, context=type(self).__name__)
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap,
                         attn_type, kv_cache_dtype)
        self.kernels = self.load_kernels()
        if kv_cache_dtype is not None and is_quantized(kv_cache_dtype) and (
                self.kernels.version != 3 or kv_cache_dtype != torch.float8_e4m3fn):
            why = (f"kv_cache_dtype {kv_cache_dtype_name(kv_cache_dtype)} not supported: FlashAttention 3 reads "
                   "fp8_e4m3 caches only" if self.kernels.version == 3 else
                   "fp8 KV cache not supported: FlashAttention 2's flash_attn_varlen_func takes no descale "
                   "arguments (FlashAttention 3's flash_attn_with_kvcache does)")
            raise BackendUnsupportedError(self.backend_name, [why], context=type(self).__name__)
        self.window_size = fa_window_size(sliding_window)
        self.softcap = float(logits_soft_cap or 0.0)
        LIVE_LAYER_PARAMS.add(self)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FlashAttnMetadata,
                output: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V at the slot mapping, then attend over the paged cache.

        Args:
            layer: the calling module, or ``None``; an fp8 cache reads its ``k_scale`` /
                ``v_scale`` / ``q_scale`` (float32 ``[]`` or ``[num_kv_heads]``, absent = 1.0).
            query: ``[num_tokens, num_heads, head_size]``, float16/bfloat16.
            key, value: ``[num_tokens, num_kv_heads, head_size]``, same dtype and device.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, same dtype and
                device; written in place at the real slots only.
            attn_metadata: what :class:`FlashAttnMetadataBuilder` built this step.
            output: ``[num_tokens, num_heads, head_size]``; the first ``len(slot_mapping)``
                rows are overwritten (rows of padded tokens hold unspecified values).

        Returns:
            ``output``.

        Raises:
            MetadataError: shapes that disagree with each other or with the metadata; and
                where index values are checked (CPU tensors always, a GPU with
                ``ATTNPLUG_VALIDATE=1``: :mod:`~attnplug.backends.common.value_checks`) a slot
                or block id outside ``kv_cache`` or lengths that disagree (the cache is
                unchanged then).

        Does not synchronise with the host (unless ``ATTNPLUG_VALIDATE=1``);
        graph-capturable when the metadata is.
        """
        md = attn_metadata
        self._check(query, key, value, kv_cache, md, output)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_tokens = md.slot_mapping.shape[0]
        if values_checked(query.device):  # the kernels trust these values; checked before the write
            check_slots(md.slot_mapping, key_cache.shape[0], md.block_size, "flash_attn forward")
            check_batch(md.query_start_loc, md.seq_lens, md.block_table, num_reqs=md.query_start_loc.shape[0] - 1,
                        num_tokens=query.shape[0], num_blocks=key_cache.shape[0], block_size=md.block_size,
                        where="flash_attn forward")
        k_scale, v_scale = kv_scales_for(layer, self.num_kv_heads, key_cache.dtype, "flash_attn forward")
        write_kv_by_slot(key, value, key_cache, value_cache, md.slot_mapping, k_scale, v_scale)
        batch = md.query_start_loc.shape[0] - 1
        if self.kernels.version == 2 and md.max_query_len == 1 and num_tokens > batch:
            # FA2 runs single-query GQA batches with q viewed as [batch, ...] (mha_varlen_fwd's
            # "seqlenq_ngroups_swapped"): the rows past the requests are padding; drop them
            num_tokens = batch
        q = query[:num_tokens]
        scales = None
        if is_quantized(key_cache.dtype):  # FA3: q in the cache's fp8 dtype, descales per KV head
            q_scale = self._q_scale(layer)
            q = quantize_query(q, q_scale, self.num_kv_heads, key_cache.dtype)
            scales = tuple(per_head_scales(s, self.num_kv_heads, q.device) for s in (q_scale, k_scale, v_scale))
        if md.cascade is None:
            out = self._attend(q, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.cu_seqlens_k,
                               md.block_table, md.max_query_len, md.max_seq_len, md.causal, md.window_size,
                               md.scheduler_metadata, scales=scales)
        else:
            c = md.cascade
            prefix_out, prefix_lse = self._attend(
                q, key_cache, value_cache, c.cu_prefix_query_lens, c.prefix_kv_lens, c.cu_prefix_kv_lens,
                c.prefix_block_table, md.num_actual_tokens, c.common_prefix_len, False, (-1, -1), None,
                return_lse=True, scales=scales)
            suffix_out, suffix_lse = self._attend(
                q, key_cache, value_cache, md.query_start_loc, c.suffix_kv_lens, c.cu_suffix_kv_lens,
                c.suffix_block_table, md.max_query_len, c.max_suffix_kv_len, md.causal, md.window_size, None,
                return_lse=True, scales=scales)
            out = merge_attn_states(suffix_out, suffix_lse, prefix_out, prefix_lse)
        output[:num_tokens].copy_(out)
        return output

    def _q_scale(self, layer: Any) -> torch.Tensor | None:
        """The layer's ``q_scale`` (``None`` = 1.0), validated like ``k_scale``."""
        q_scale = layer_q_scale(layer)
        problems = scale_problems(q_scale, self.num_kv_heads, "q_scale")
        if problems:
            raise MetadataError("flash_attn forward: " + "; ".join(problems) + " (core/kv_quant.py)")
        return q_scale

    def _attend(self, q, key_cache, value_cache, cu_seqlens_q, seqused_k, cu_seqlens_k, block_table,
                max_seqlen_q, max_seqlen_k, causal, window_size, scheduler_metadata, return_lse=False, scales=None):
        """One kernel call in the installed version's convention; ``(out, lse)`` with
        ``return_lse`` (``lse``: ``[num_heads, num_tokens]`` float32, natural log). ``scales``:
        an fp8 call's ``(q, k, v)`` scales, each float32 ``[num_kv_heads]``, passed to FA3 as
        ``*_descale`` ``[batch_size, num_kv_heads]`` (a stride-0 expand, no copy)."""
        k = self.kernels
        if k.version == 3:
            fp8 = {}
            if scales is not None:
                shape = (cu_seqlens_q.shape[0] - 1, self.num_kv_heads)
                fp8 = {f"{n}_descale": s.expand(shape) for n, s in zip("qkv", scales)}
            res = k.with_kvcache(
                q, key_cache, value_cache, cache_seqlens=seqused_k, page_table=block_table,
                cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=self.scale, causal=causal,
                window_size=window_size, softcap=self.softcap, scheduler_metadata=scheduler_metadata,
                return_softmax_lse=return_lse, **fp8)
        else:
            res = k.varlen_func(
                q, key_cache, value_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                dropout_p=0.0, softmax_scale=self.scale, causal=causal, window_size=window_size,
                softcap=self.softcap, return_attn_probs=return_lse, block_table=block_table)
        return (res[0], res[1]) if return_lse else res

    def _check(self, query, key, value, kv_cache, md, output) -> None:
        if not isinstance(md, FlashAttnMetadata):
            raise MetadataError(f"attn_metadata is a {type(md).__name__}, not FlashAttnMetadata: the layer's "
                                "metadata must come from the flash_attn builder of its cache group.")
        problems = qkv_shape_problems(query, key, value, self.num_heads, self.num_kv_heads, self.head_size)
        if output.shape != query.shape:
            problems.append(f"output {tuple(output.shape)} should match query {tuple(query.shape)}")
        if min(query.shape[0], key.shape[0], value.shape[0]) < md.slot_mapping.shape[0]:
            problems.append(f"query/key/value have fewer rows than the slot mapping ({md.slot_mapping.shape[0]})")
        shape = (2, md.block_size, self.num_kv_heads, self.head_size)
        if kv_cache.dim() != 5 or (kv_cache.shape[0], *kv_cache.shape[2:]) != shape:
            problems.append(f"kv_cache {tuple(kv_cache.shape)} should be [2, num_blocks, {md.block_size}, "
                            f"{self.num_kv_heads}, {self.head_size}]")
        if md.window_size != self.window_size:
            problems.append(f"the metadata's window_size {md.window_size} differs from this layer's "
                            f"{self.window_size} (sliding_window={self.sliding_window}): the cache group's spec "
                            "and the layer disagree")
        if problems:
            raise MetadataError("flash_attn forward: " + "; ".join(problems)
                                + ". Pass tensors shaped as the layer config and the cache group's spec say.")
