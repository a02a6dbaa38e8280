"""Deliberately broken backends: the conformance suite must fail each of them.

Each is torch_native with one realistic bug. Imported by module path
(``--attnplug-backend broken_backends:Name``) from the teeth tests. The last two are
correct but cannot be tested here (unavailable; declarations that rule out every case):
a run must not pass on them either, since it would have tested nothing.
"""

from __future__ import annotations

import dataclasses

import torch

from attnplug.backends.torch_native import (
    TorchNativeAttentionImpl,
    TorchNativeBackend,
    TorchNativeMetadataBuilder,
)


def _backend(name: str, builder=None, impl=None) -> type:
    ns = {"get_name": classmethod(lambda cls: name)}
    if builder is not None:
        ns["get_builder_cls"] = classmethod(lambda cls: builder)
    if impl is not None:
        ns["get_impl_cls"] = classmethod(lambda cls: impl)
    return type(name, (TorchNativeBackend,), ns)


class _OffByOneBuilder(TorchNativeMetadataBuilder):
    """Writes every token's K/V one slot too far."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return dataclasses.replace(md, write_slots=md.write_slots + 1)


class _WritesPaddingBuilder(TorchNativeMetadataBuilder):
    """Writes every row of slot_mapping, padded tokens (PAD_SLOT_ID) included."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        sm = common_attn_metadata.slot_mapping
        return dataclasses.replace(md, write_slots=sm.clone(), write_token_indices=torch.arange(sm.shape[0]))


class _MutatingBuilder(TorchNativeMetadataBuilder):
    """Correct metadata, but scribbles on the CommonAttentionMetadata it was given."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        common_attn_metadata.max_seq_len += 1
        return md


class _NoWindowBuilder(TorchNativeMetadataBuilder):
    """Key ranges from position 0 even for a sliding-window spec (pairs with ``_NoWindowImpl``;
    torch_native's own builder would start them at the window, which its impl checks)."""

    sliding_window = None


class _NoWindowImpl(TorchNativeAttentionImpl):
    """Claims sliding-window support but attends over the whole sequence."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window=None, *args, **kwargs):
        super().__init__(num_heads, head_size, scale, num_kv_heads, None, *args, **kwargs)


class _WrongScaleImpl(TorchNativeAttentionImpl):
    """Uses 1.25x the softmax scale it was given."""

    def __init__(self, num_heads, head_size, scale, *args, **kwargs):
        super().__init__(num_heads, head_size, scale * 1.25, *args, **kwargs)


class _IgnoresScaleImpl(TorchNativeAttentionImpl):
    """Uses ``head_size ** -0.5`` whatever scale it was given (wrong on Gemma's
    ``query_pre_attn_scalar`` and every model whose scale is not the default)."""

    def __init__(self, num_heads, head_size, scale, *args, **kwargs):
        super().__init__(num_heads, head_size, head_size ** -0.5, *args, **kwargs)


class _NaNLastTokenImpl(TorchNativeAttentionImpl):
    """Never computes the last real token's row (a loop bound one short), which keeps the
    NaN its output buffer held: correct everywhere else, and the K/V writes are right."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        n = attn_metadata.num_actual_tokens
        if n:
            output[n - 1] = float("nan")
        return out


OffByOneSlots = _backend("off_by_one_slots", builder=_OffByOneBuilder)
WritesPaddedSlots = _backend("writes_padded_slots", builder=_WritesPaddingBuilder)
MutatesMetadata = _backend("mutates_metadata", builder=_MutatingBuilder)
IgnoresWindow = _backend("ignores_window", builder=_NoWindowBuilder, impl=_NoWindowImpl)
WrongScale = _backend("wrong_scale", impl=_WrongScaleImpl)
IgnoresScale = _backend("ignores_scale", impl=_IgnoresScaleImpl)
NaNOutput = _backend("nan_output", impl=_NaNLastTokenImpl)

Unavailable = type("unavailable", (TorchNativeBackend,), {
    "get_name": classmethod(lambda cls: "unavailable"),
    "is_available": classmethod(lambda cls: (False, "needs the moon"))})
HeadSize8Only = type("head_size_8_only", (TorchNativeBackend,), {
    "get_name": classmethod(lambda cls: "head_size_8_only"), "supported_head_sizes": (8,)})
