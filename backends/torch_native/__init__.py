"""``torch_native``: the pure-torch reference attention backend (the conformance oracle)."""

from attnplug.backends.torch_native.backend import TorchNativeBackend
from attnplug.backends.torch_native.builder import (
    AttentionSegment,
    TorchNativeMetadata,
    TorchNativeMetadataBuilder,
)
from attnplug.backends.torch_native.impl import TorchNativeAttentionImpl

__all__ = [
    "AttentionSegment", "TorchNativeAttentionImpl", "TorchNativeBackend", "TorchNativeMetadata",
    "TorchNativeMetadataBuilder",
]
