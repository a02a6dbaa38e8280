"""``cpu_sdpa``: paged attention for the CPU through torch's fused
``scaled_dot_product_attention`` kernel (the default on CPU; see docs/backends.md)."""

from attnplug.backends.cpu_sdpa.backend import CpuSdpaBackend
from attnplug.backends.cpu_sdpa.impl import CpuSdpaAttentionImpl

__all__ = ["CpuSdpaAttentionImpl", "CpuSdpaBackend"]
