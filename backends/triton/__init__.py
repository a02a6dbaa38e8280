"""``triton``: attnplug's own paged attention kernels in Triton.

The backend that runs wherever Triton runs: compiled on NVIDIA/AMD GPUs, or in the
Triton interpreter on the CPU under ``TRITON_INTERPRET=1`` (for tests). Importing this
package never imports ``triton`` (the kernel modules load on first launch, see
``runtime.py``), so the backend registers and reports itself unavailable without it.

Modules:

* ``backend.py`` — :class:`TritonBackend` (capabilities, availability, validation);
* ``metadata.py`` — :class:`TritonAttentionMetadata`, :class:`TritonCascadeMetadata`,
  :class:`SplitKVPolicy`;
* ``builder.py`` — :class:`TritonMetadataBuilder` (persistent buffers, CUDA graphs ALWAYS);
* ``impl.py`` — :class:`TritonAttentionImpl`;
* ``attention.py`` — :func:`paged_attention` (tile choice, launches; optional LSE);
* ``cascade.py`` — cascade attention: prefix pass + suffix pass + ``merge_attn_states``;
* ``cache_ops.py`` — :func:`write_kv_cache`, :func:`compute_slot_mapping`;
* ``attention_kernels.py``, ``cache_kernels.py`` — the ``@triton.jit`` kernels;
* ``runtime.py`` — availability and mode-aware kernel loading;
* ``constants.py`` — the size limits (head sizes, kernel block sizes) every module above reads.
"""

from attnplug.backends.triton.attention import TileConfig, choose_tiles, paged_attention
from attnplug.backends.triton.backend import TritonBackend
from attnplug.backends.triton.builder import TritonMetadataBuilder
from attnplug.backends.triton.cache_ops import compute_slot_mapping, write_kv_cache
from attnplug.backends.triton.impl import TritonAttentionImpl
from attnplug.backends.triton.metadata import SplitKVPolicy, TritonAttentionMetadata, TritonCascadeMetadata

__all__ = [
    "SplitKVPolicy", "TileConfig", "TritonAttentionImpl", "TritonAttentionMetadata", "TritonBackend",
    "TritonCascadeMetadata", "TritonMetadataBuilder", "choose_tiles", "compute_slot_mapping", "paged_attention",
    "write_kv_cache",
]
