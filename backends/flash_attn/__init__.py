"""``flash_attn``: paged varlen attention with the FlashAttention kernels (optional extra).

Importing this package never imports ``flash_attn``: :class:`FlashAttnBackend` registers
everywhere and says through ``is_available()`` why it cannot run (missing package, no
CUDA). On machines without a GPU its lowering is checked against a CPU emulator of the
kernel contract (``attnplug.backends.emulators``).

Modules: ``backend.py`` (capabilities), ``kernels.py`` (finding FA2/FA3), ``metadata.py``
and ``builder.py`` (the lowering), ``impl.py`` (the kernel call).
"""

from attnplug.backends.flash_attn.backend import FlashAttnBackend
from attnplug.backends.flash_attn.builder import FlashAttnMetadataBuilder
from attnplug.backends.flash_attn.impl import FlashAttnImpl
from attnplug.backends.flash_attn.kernels import FlashAttnKernels, installed_kernels
from attnplug.backends.flash_attn.metadata import FlashAttnCascadeMetadata, FlashAttnMetadata

__all__ = [
    "FlashAttnBackend", "FlashAttnCascadeMetadata", "FlashAttnImpl", "FlashAttnKernels", "FlashAttnMetadata",
    "FlashAttnMetadataBuilder", "installed_kernels",
]
