"""``TorchNativeAttentionImpl``: write K/V into the paged cache, then attend through it."""

from __future__ import annotations

from typing import Any

import torch

from attnplug.backends.torch_native.attention import (
    attend,
    gather_from_paged_cache,
    keys_used,
    visibility_mask,
    write_to_paged_cache,
)
from attnplug.backends.torch_native.builder import AttentionSegment, TorchNativeMetadata
from attnplug.backends.torch_native.cascade import cascade_forward
from attnplug.backends.common.decoder_impl import SinksAlibiDecoderImpl
from attnplug.backends.common.shape_checks import qkv_shape_problems
from attnplug.backends.common.kv_scales import kv_scales_for
from attnplug.backends.common.value_checks import check_slots, values_checked
from attnplug.core.errors import MetadataError

QUERY_TILE_TOKENS: int = 256
"""Queries of one request attended per op. Bounds the float32 logits temporary (a 4096-token
prompt would otherwise need ``num_heads * 4096 * 4096 * 4`` bytes per temporary); never
changes the result."""


class TorchNativeAttentionImpl(SinksAlibiDecoderImpl):
    """The reference attention of one layer (see ``attention.py`` for the math).

    ``TorchNativeAttentionImpl(num_heads, head_size, scale, num_kv_heads,
    sliding_window=None, logits_soft_cap=None, attn_type=AttentionType.DECODER,
    kv_cache_dtype=None, sinks=None, alibi_slopes=None)``; ``sinks``: ``[num_heads]`` float32
    sink logits (the contract's semantics, ``core/contracts.AttentionImpl``), on full and
    windowed layers; ``alibi_slopes``: ``[num_heads]`` float32 ALiBi slopes (vLLM's impl
    argument): head ``h``'s logit of a key ``d`` positions back gets ``- slopes[h] * d``
    (not on cascade steps: refused).

    Raises:
        BackendUnsupportedError: ``num_heads`` not a multiple of ``num_kv_heads``, a
            non-positive window or cap, an attention type other than decoder, or ``sinks`` /
            ``alibi_slopes`` that is not a ``[num_heads]`` float32 tensor.

    Examples:
        >>> import torch
        >>> from attnplug.backends.torch_native import TorchNativeBackend
        >>> from attnplug.cache_groups.specs import FullAttentionSpec
        >>> from attnplug.core import BuilderConfig, CommonAttentionMetadata
        >>> spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8)
        >>> builder = TorchNativeBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(2, 16, 16), "cpu")
        >>> cm = CommonAttentionMetadata.from_lengths([0, 3], [3, 1], [[1, 0], [2, 0]], block_size=4)
        >>> meta = builder.build(0, cm)
        >>> impl = TorchNativeBackend.get_impl_cls()(2, 8, 8 ** -0.5, 1)
        >>> kv_cache = torch.zeros(TorchNativeBackend.get_kv_cache_shape(3, 4, 1, 8))
        >>> q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
        >>> impl.forward(None, q, k, v, kv_cache, meta, torch.zeros(4, 2, 8)).shape
        torch.Size([4, 2, 8])
    """

    backend_name = "torch_native"
    impl_name = "TorchNativeAttentionImpl"
    # the constructor (argument checks, then ``alibi_slopes``, ``attention.attend``'s ``alibi``)
    # is backends/common/decoder_impl.SinksAlibiDecoderImpl's

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TorchNativeMetadata,
                output: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V at the slot mapping, then attend over the paged cache.

        Args:
            layer: the calling module, or ``None``; an fp8 cache reads its ``k_scale`` /
                ``v_scale`` (float32 ``[]`` or ``[num_kv_heads]``; absent = 1.0,
                ``core/kv_quant.py``).
            query: ``[num_tokens, num_heads, head_size]``, float32/float16/bfloat16.
            key, value: ``[num_tokens, num_kv_heads, head_size]``, same dtype and device.
            kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (K at index
                0, V at 1), same device, any float dtype or fp8 (``stored = saturate(x /
                scale)``, dequantised on read); written in place at the real slots only.
            attn_metadata: what :class:`TorchNativeMetadataBuilder` built this step.
            output: ``[num_tokens, num_heads, head_size]``, same device; rows
                ``< num_actual_tokens`` are overwritten, padded rows are left untouched.

        Returns:
            ``output``.

        Raises:
            MetadataError: shapes that disagree with each other or with the metadata, a
                tensor that is not floating point, or (where index values are checked:
                always on the CPU) a write slot outside ``kv_cache``; the cache is unchanged.

        Numerics: logits, softmax and the weighted sum run in float32; the result is cast
        to ``output.dtype``. Does not synchronise with the host.
        """
        self._check(query, key, value, kv_cache, attn_metadata, output)
        md = attn_metadata
        scales = kv_scales_for(layer, self.num_kv_heads, kv_cache.dtype, "torch_native forward")
        self._check_write_slots(md, kv_cache, "torch_native forward")
        write_to_paged_cache(key, value, kv_cache, md.write_slots, md.write_token_indices, *scales)
        if md.cascade is not None:  # a shared prefix pass + suffix pass (cascade.py)
            if self.alibi_slopes is not None:
                raise MetadataError("torch_native forward: a cascade step on an ALiBi layer (cascade.py's passes "
                                    "add no position bias); run without cascade attention")
            return cascade_forward(self, query, kv_cache, md, output, scales)
        for seg in md.segments:
            num_keys = seg.key_block_ids.shape[1] * md.block_size  # key columns, from key_offsets on
            offsets = seg.key_offsets if seg.max_key_offset else None
            used = keys_used(seg.seq_lens, seg.query_len, num_keys, self.sliding_window, offsets)
            keys, values = gather_from_paged_cache(kv_cache, seg.key_block_ids, used, *scales)  # [n, keys, H_kv, D]
            for q_lo, q_hi, k_lo, k_hi in self._tiles(seg, md.causal, num_keys):
                tokens = seg.query_token_indices[:, q_lo:q_hi]
                q = query[tokens]  # [n, tile, num_heads, head_size]
                mask = visibility_mask(seg.query_positions[:, q_lo:q_hi], seg.seq_lens, k_lo, k_hi,
                                       causal=md.causal, sliding_window=self.sliding_window, key_offsets=offsets)
                out = attend(q, keys[:, k_lo:k_hi], values[:, k_lo:k_hi], mask, self.scale,
                             self.logits_soft_cap, self._sinks_on(query.device),
                             self._alibi(seg.query_positions[:, q_lo:q_hi], k_lo, k_hi, offsets))
                output[tokens.flatten()] = out.flatten(0, 1).to(output.dtype)
        return output

    def _alibi(self, query_positions: torch.Tensor, k_lo: int, k_hi: int, key_offsets: torch.Tensor | None):
        """``attend``'s ``(slopes, distance)`` for key columns ``k_lo .. k_hi - 1`` (column
        ``j`` is position ``key_offsets + j``), or ``None`` without ALiBi."""
        if self.alibi_slopes is None:
            return None
        dev = query_positions.device
        if self.alibi_slopes.device != dev:
            self.alibi_slopes = self.alibi_slopes.to(dev)
        key_pos = torch.arange(k_lo, k_hi, device=dev).unsqueeze(0)
        if key_offsets is not None:
            key_pos = key_pos + key_offsets.unsqueeze(1)
        return self.alibi_slopes, (query_positions.unsqueeze(2) - key_pos.unsqueeze(1)).float()

    def _sinks_on(self, device: torch.device) -> torch.Tensor | None:
        """``self.sinks`` on ``device`` (moved once; ``None`` without sinks)."""
        if self.sinks is not None and self.sinks.device != device:
            self.sinks = self.sinks.to(device)
        return self.sinks

    def _tiles(self, seg: AttentionSegment, causal: bool, num_keys: int) -> list[tuple[int, int, int, int]]:
        """Split a segment into query tiles, each with the key columns it can see.

        Returns ``(q_lo, q_hi, k_lo, k_hi)`` tuples (ends exclusive): queries ``q_lo ..
        q_hi - 1`` of every request in the segment need at most key columns ``k_lo ..
        k_hi - 1``. Query ``j`` of a request with ``seq_len`` tokens sits at ``seq_len -
        query_len + j``, so a causal tile needs no key position past ``max_seq_len -
        query_len + q_hi - 1``, and a window ``W`` none before ``min_seq_len - query_len +
        q_lo - W + 1``; column ``c`` of request ``r`` is position ``key_offsets[r] + c``, so
        the positions become columns by subtracting the largest (low end) and smallest
        (high end) offset. This bounds the float32 logits of one tile to ``n * num_heads *
        QUERY_TILE_TOKENS * keys``; the keys skipped would be masked anyway, so tiling never
        changes the result's math.
        """
        tiles = []
        for q_lo in range(0, seg.query_len, QUERY_TILE_TOKENS):
            q_hi = min(q_lo + QUERY_TILE_TOKENS, seg.query_len)
            k_hi = seg.max_seq_len - seg.query_len + q_hi if causal else seg.max_seq_len
            k_lo = 0
            if self.sliding_window is not None:
                k_lo = max(0, seg.min_seq_len - seg.query_len + q_lo - self.sliding_window + 1)
            k_lo = max(0, k_lo - seg.max_key_offset)
            k_hi = min(num_keys, k_hi - seg.min_key_offset)
            tiles.append((q_lo, q_hi, k_lo, max(k_hi, k_lo + 1)))
        return tiles

    @staticmethod
    def _check_write_slots(md, kv_cache: torch.Tensor, where: str) -> None:
        """Every slot this step writes lies inside ``kv_cache`` (``[num_blocks, 2,
        block_size, ...]``) where the device's index values are checked (always on the
        CPU; ``values_checked``): torch's advanced indexing would wrap a negative slot into
        the cache's last blocks silently.

        Raises:
            MetadataError: naming the first slot outside the cache; the cache is unchanged.
        """
        if values_checked(kv_cache.device):
            check_slots(md.write_slots, kv_cache.shape[0], kv_cache.shape[2], where)

    def _check(self, query, key, value, kv_cache, md, output) -> None:
        if not isinstance(md, TorchNativeMetadata):
            raise MetadataError(
                f"attn_metadata is a {type(md).__name__}, not TorchNativeMetadata: the layer's "
                "metadata must come from the torch_native builder of its cache group.")
        if md.sliding_window is not None and (self.sliding_window is None
                                              or self.sliding_window > md.sliding_window):
            raise MetadataError(
                f"the metadata's key ranges start at a {md.sliding_window}-token window but this layer "
                f"attends with sliding_window={self.sliding_window}: it would miss keys. A layer must sit "
                "in a cache group whose SlidingWindowSpec has its window (or a FullAttentionSpec group).")
        problems = qkv_shape_problems(query, key, value, self.num_heads, self.num_kv_heads, self.head_size)
        if output.shape != query.shape:
            problems.append(f"output {tuple(output.shape)} should match query {tuple(query.shape)}")
        n = md.num_actual_tokens
        if min(query.shape[0], key.shape[0], value.shape[0]) < n:
            problems.append(f"query/key/value have fewer rows than num_actual_tokens={n}")
        shape = (2, md.block_size, self.num_kv_heads, self.head_size)
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != shape:
            problems.append(f"kv_cache {tuple(kv_cache.shape)} should be [num_blocks, {', '.join(map(str, shape))}]")
        not_float = [name for name, t in (("query", query), ("key", key), ("value", value), ("kv_cache", kv_cache),
                                          ("output", output)) if not t.is_floating_point()]
        if not_float:
            problems.append(f"{'/'.join(not_float)} must be floating point (got "
                            f"{', '.join(str(t.dtype) for t in (query, key, value, kv_cache, output))})")
        if problems:
            raise MetadataError("torch_native forward: " + "; ".join(problems)
                                + ". Pass tensors shaped as the layer config and the cache group's spec say.")
