"""``cpu_sdpa``: paged attention for the CPU (the default on CPU; see docs/backends.md): a
compiled kernel reading the paged cache in place (``paged.py``), else torch's fused
``scaled_dot_product_attention`` on gathered blocks."""

from attnplug.backends.cpu_sdpa.backend import CpuSdpaBackend
from attnplug.backends.cpu_sdpa.impl import CpuSdpaAttentionImpl

__all__ = ["CpuSdpaAttentionImpl", "CpuSdpaBackend"]
