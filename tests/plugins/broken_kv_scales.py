"""Backends that read or write fp8 KV caches with the wrong scales: the suite's fp8 cases
must fail each of them (``test_fp8_conformance_teeth.py``). Each is torch_native with one
realistic bug (flashinfer#4979: a path ignoring ``k_scale`` / ``v_scale``; sglang#20705:
scales silently dropped)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace


from attnplug.backends.torch_native import TorchNativeAttentionImpl, TorchNativeBackend
from attnplug.backends.torch_native.attention import write_to_paged_cache


def _backend(name: str, impl) -> type:
    return type(name, (TorchNativeBackend,), {"get_name": classmethod(lambda cls: name),
                                              "get_impl_cls": classmethod(lambda cls: impl)})


class _IgnoresScalesImpl(TorchNativeAttentionImpl):
    """Never looks at the layer's scales: writes x and reads stored values as they are."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        return super().forward(None, query, key, value, kv_cache, attn_metadata, output)


class _ReadIgnoresScalesImpl(TorchNativeAttentionImpl):
    """Writes with the scales (a shared cache-write op) but attends over the stored values."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        md = attn_metadata
        write_to_paged_cache(key, value, kv_cache, md.write_slots, md.write_token_indices, layer.k_scale,
                             layer.v_scale)
        none = md.write_slots[:0]
        md = dataclasses.replace(md, write_slots=none, write_token_indices=md.write_token_indices[:0])
        return super().forward(None, query, key, value, kv_cache, md, output)


class _HeadZeroScaleImpl(TorchNativeAttentionImpl):
    """Uses KV head 0's scale for every head (a per-head scale read as per-tensor)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        first = SimpleNamespace(**{n: getattr(layer, n).reshape(-1)[:1].expand(self.num_kv_heads).contiguous()
                                   for n in ("k_scale", "v_scale")})
        return super().forward(first, query, key, value, kv_cache, attn_metadata, output)


IgnoresKVScales = _backend("ignores_kv_scales", _IgnoresScalesImpl)
ReadIgnoresKVScales = _backend("read_ignores_kv_scales", _ReadIgnoresScalesImpl)
HeadZeroKVScale = _backend("head_zero_kv_scale", _HeadZeroScaleImpl)
NoFp8 = type("no_fp8", (TorchNativeBackend,), {"get_name": classmethod(lambda cls: "no_fp8"),
                                                "supported_kv_cache_dtypes": ("auto",)})
"""Correct, and declares no fp8: its fp8 cases are skipped, and selection refuses it for an fp8 layer."""
