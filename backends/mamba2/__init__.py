"""``mamba2_torch``: Mamba2 state-slot backend (builder, torch mixer core, optional kernels)."""

from attnplug.backends.mamba2.backend import Mamba2Backend
from attnplug.backends.mamba2.impl import Mamba2Impl
from attnplug.backends.mamba2.layout import PrefillLayout, compute_prefill_layout
from attnplug.backends.mamba2.metadata import Mamba2Metadata, Mamba2MetadataBuilder

__all__ = [
    "Mamba2Backend", "Mamba2Impl", "Mamba2Metadata", "Mamba2MetadataBuilder", "PrefillLayout",
    "compute_prefill_layout",
]
