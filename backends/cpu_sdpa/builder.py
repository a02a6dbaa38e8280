"""``CpuSdpaMetadataBuilder``: ``torch_native``'s per-step lowering, reused as is.

Its segments are what the fused kernel wants: every decode in one segment (one batched
call), each multi-token request its own (no query padding), the block ids of each
segment's key range computed once per step on the host for all layers of the group.
"""

from __future__ import annotations

from attnplug.backends.torch_native.builder import TorchNativeMetadata, TorchNativeMetadataBuilder


class CpuSdpaMetadataBuilder(TorchNativeMetadataBuilder):
    """Builds :class:`~attnplug.backends.torch_native.builder.TorchNativeMetadata` (see
    that builder: same fields, same cascade and ``update_block_table`` support)."""


CpuSdpaMetadata = TorchNativeMetadata
"""The metadata type ``cpu_sdpa`` layers read (``torch_native``'s)."""

__all__ = ["CpuSdpaMetadata", "CpuSdpaMetadataBuilder"]
