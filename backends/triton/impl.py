"""``TritonAttentionImpl``: write this step's K/V with the cache kernel, then run the paged
attention kernels (unified, or split-KV + reduce)."""

from __future__ import annotations

from typing import Any

import torch

from attnplug.backends.triton.attention import paged_attention
from attnplug.backends.triton.cache_ops import write_kv_cache
from attnplug.backends.triton.cascade import cascade_attention
from attnplug.backends.triton.constants import HEAD_SIZES
from attnplug.backends.triton.metadata import TritonAttentionMetadata
from attnplug.backends.triton.runtime import interpreting
from attnplug.backends.common.value_checks import check_batch, check_slots, values_checked
from attnplug.backends.common.shape_checks import qkv_shape_problems
from attnplug.backends.common.kv_scales import kv_scales_for
from attnplug.backends.common.decoder_impl import SinksAlibiDecoderImpl
from attnplug.core.kv_quant import FP8_DTYPES
from attnplug.core.errors import MetadataError


class TritonAttentionImpl(SinksAlibiDecoderImpl):
    """The attention of one layer with the Triton kernels.

    ``TritonAttentionImpl(num_heads, head_size, scale, num_kv_heads, sliding_window=None,
    logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_cache_dtype=None, sinks=None)``;
    ``alibi_slopes=None`` (``[num_heads]`` float32 ALiBi slopes, in the kernel; an ALiBi layer
    attends in one pass on cascade steps too);
    ``sinks``: ``[num_heads]`` float32 sink logits (``core/contracts.AttentionImpl``), applied
    in the kernel's online softmax (full, windowed, split-KV and cascade steps).

    Raises:
        BackendUnsupportedError: ``num_heads`` not a multiple of ``num_kv_heads``, a head
            size the kernels do not take, a non-positive window or cap, or an attention
            type other than decoder, or ``sinks`` that is not a ``[num_heads]`` float32 tensor.

    Examples (on the CPU this needs ``TRITON_INTERPRET=1`` in the environment):
        >>> import torch
        >>> from attnplug.backends.triton import TritonBackend
        >>> from attnplug.cache_groups.specs import FullAttentionSpec
        >>> from attnplug.core import BuilderConfig, CommonAttentionMetadata
        >>> spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16)
        >>> builder = TritonBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(2, 16, 32), "cpu")
        >>> cm = CommonAttentionMetadata.from_lengths([0, 3], [3, 1], [[1, 0], [2, 0]], block_size=16)
        >>> meta = builder.build(0, cm)
        >>> impl = TritonBackend.get_impl_cls()(2, 16, 16 ** -0.5, 1)
        >>> kv_cache = torch.zeros(TritonBackend.get_kv_cache_shape(3, 16, 1, 16))
        >>> q, k, v = torch.randn(4, 2, 16), torch.randn(4, 1, 16), torch.randn(4, 1, 16)
        >>> impl.forward(None, q, k, v, kv_cache, meta, torch.zeros(4, 2, 16)).shape
        torch.Size([4, 2, 16])
    """

    backend_name = "triton"
    impl_name = "TritonAttentionImpl"
    # the constructor (argument checks, then ``alibi_slopes``, ``paged_attention(alibi_slopes=)``)
    # is backends/common/decoder_impl.SinksAlibiDecoderImpl's, with this limit:

    @classmethod
    def extra_argument_problems(cls, head_size: int) -> list[str]:
        """A head size the kernels do not take (``constants.HEAD_SIZES``)."""
        if head_size not in HEAD_SIZES:
            return [f"head_size {head_size} not supported (multiples of 16 up to {HEAD_SIZES[-1]})"]
        return []

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TritonAttentionMetadata,
                output: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V at the slot mapping, then attend over the paged cache.

        Args:
            layer: the calling module, or ``None``; an fp8 cache reads its ``k_scale`` /
                ``v_scale`` (float32 ``[]`` or ``[num_kv_heads]``; absent = 1.0,
                ``core/kv_quant.py``).
            query: ``[num_tokens, num_heads, head_size]``, float32/float16/bfloat16.
            key, value: ``[num_tokens, num_kv_heads, head_size]``, same dtype and device.
            kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (K at index
                0, V at 1), same device, query's dtype or fp8 (``saturate(x / scale)``,
                dequantised in the kernel); written in place at the real slots only.
            attn_metadata: what :class:`TritonMetadataBuilder` built this step.
            output: ``[num_tokens, num_heads, head_size]``, same dtype and device; rows of
                real tokens are overwritten, padded rows are left untouched.

        Returns:
            ``output``.

        Raises:
            MetadataError: shapes, dtypes or devices that disagree with each other or with
                the metadata, CPU tensors while the kernels are compiled for a GPU,
                bfloat16 under the interpreter; and where index values are checked (CPU
                tensors always, a GPU with ``ATTNPLUG_VALIDATE=1``:
                :mod:`~attnplug.backends.common.value_checks`) a slot or block id outside
                ``kv_cache`` or lengths that disagree. The cache is unchanged then.

        With ``attn_metadata.cascade`` (full attention only; a windowed layer ignores it and
        attends in one pass) the attention is the prefix pass + suffix pass + merge of
        ``backends/triton/cascade.py`` (fp32 partials, four more launches and a few torch ops).

        Numerics: fp32 logits, online softmax and accumulator; the result is stored in the
        query's dtype. Does not synchronise with the host on a GPU unless
        ``ATTNPLUG_VALIDATE=1`` (two or three kernel launches).
        """
        md = attn_metadata
        self._check(query, key, value, kv_cache, md, output)
        key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
        num_writes = min(key.shape[0], md.slot_mapping.shape[0])
        if values_checked(query.device):  # before the write: a bad batch changes nothing
            check_slots(md.slot_mapping[:num_writes], kv_cache.shape[0], md.block_size, "triton forward")
            check_batch(md.query_start_loc, md.seq_lens, md.block_table_tensor, num_reqs=md.num_reqs,
                        num_tokens=query.shape[0], num_blocks=kv_cache.shape[0], block_size=md.block_size,
                        where="triton forward")
        k_scale, v_scale = kv_scales_for(layer, self.num_kv_heads, kv_cache.dtype, "triton forward")
        write_kv_cache(key[:num_writes], value[:num_writes], key_cache, value_cache, md.slot_mapping[:num_writes],
                       check_values=False, k_scale=k_scale, v_scale=v_scale)
        sinks = self._sinks_on(query.device)
        alibi = self.alibi_slopes
        if alibi is not None and alibi.device != query.device:
            alibi = self.alibi_slopes = alibi.to(query.device)
        if md.cascade is not None and self.sliding_window is None and alibi is None:
            return cascade_attention(query, key_cache, value_cache, output, md, scale=self.scale,
                                     logits_soft_cap=self.logits_soft_cap, sinks=sinks, k_scale=k_scale,
                                     v_scale=v_scale)
        return paged_attention(
            query, key_cache, value_cache, output, md.query_start_loc, md.seq_lens, md.block_table_tensor,
            num_reqs=md.num_reqs, max_query_len=md.max_query_len, scale=self.scale, causal=md.causal,
            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
            num_kv_splits=md.num_kv_splits, check_values=False, sinks=sinks,
            k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi)

    def _sinks_on(self, device: torch.device) -> torch.Tensor | None:
        """``self.sinks`` on ``device`` (moved once; ``None`` without sinks)."""
        if self.sinks is not None and self.sinks.device != device:
            self.sinks = self.sinks.to(device)
        return self.sinks

    def _check(self, query, key, value, kv_cache, md, output) -> None:
        if not isinstance(md, TritonAttentionMetadata):
            raise MetadataError(
                f"attn_metadata is a {type(md).__name__}, not TritonAttentionMetadata: the layer's metadata "
                "must come from the triton builder of its cache group.")
        problems = qkv_shape_problems(query, key, value, self.num_heads, self.num_kv_heads, self.head_size)
        if output.shape != query.shape:
            problems.append(f"output {tuple(output.shape)} should match query {tuple(query.shape)}")
        if min(query.shape[0], key.shape[0], value.shape[0]) < md.num_actual_tokens:
            problems.append(f"query/key/value have fewer rows than num_actual_tokens={md.num_actual_tokens}")
        shape = (2, md.block_size, self.num_kv_heads, self.head_size)
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != shape:
            problems.append(f"kv_cache {tuple(kv_cache.shape)} should be [num_blocks, {', '.join(map(str, shape))}]")
        dtypes = {t.dtype for t in (query, key, value, output)} | ({kv_cache.dtype} - set(FP8_DTYPES))
        if len(dtypes) != 1:
            problems.append(f"query/key/value/kv_cache/output dtypes differ ({sorted(map(str, dtypes))}); the "
                            "kernels need one dtype")
        devices = {t.device for t in (query, key, value, kv_cache, output, md.query_start_loc)}
        if len(devices) != 1:
            problems.append(f"tensors on several devices ({sorted(map(str, devices))})")
        elif query.device.type == "cpu" and not interpreting():
            problems.append("CPU tensors but the Triton kernels are compiled for a GPU; set TRITON_INTERPRET=1 "
                            "to run them in the Triton interpreter")
        if query.dtype == torch.bfloat16 and interpreting():
            problems.append("bfloat16 under TRITON_INTERPRET=1: the interpreter's bf16 tl.dot gives wrong results; "
                            "use float16 or float32 on the CPU (bfloat16 runs on a GPU)")
        if problems:
            raise MetadataError("triton forward: " + "; ".join(problems)
                                + ". Pass tensors shaped as the layer config and the cache group's spec say.")
