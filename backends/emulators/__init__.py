"""CPU emulators of the FlashAttention and FlashInfer kernel contracts — TEST TOOLS.

Nothing here is registered or selectable: the registry never lists these classes (they
are not in ``BUILTIN_BACKENDS`` and no plugin registers them). They are reached only by
import path, e.g. ``attnplug check attnplug.backends.emulators:FlashInferEmulatedBackend``.

* ``flash_attn_kernels.py`` — :class:`FlashAttnEmulator`: FA2 ``flash_attn_varlen_func``
  (paged), FA3 ``flash_attn_with_kvcache`` and ``get_scheduler_metadata``;
* ``flashinfer_kernels.py`` — emulated ``BatchDecodeWithPagedKVCacheWrapper`` and
  ``BatchPrefillWithPagedKVCacheWrapper`` (``plan``/``run``, CUDA-graph buffers);
* ``reference.py`` — the shared arithmetic (attention over explicit key ranges);
* ``backends.py`` — the real builders and impls wired to the emulators;
* ``mla_kernels.py`` / ``mla_backends.py`` — FlashMLA (``get_mla_metadata``,
  ``flash_mla_with_kvcache``) and FlashInfer's ``BatchMLAPagedAttentionWrapper``, and the
  ``flashmla`` / ``flashinfer_mla`` builders and impls wired to them;
* ``sparse_kernels.py`` / ``sparse_backends.py`` — FlashMLA's ``flash_mla_sparse_fwd`` and
  the ``flashmla_sparse`` impl wired to it.
* ``fla_kernels.py`` / ``fla_backends.py`` — flash-linear-attention's
  ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule``, and the ``gdn_fla``
  builder and impl wired to them (``GDNFlaEmulatedBackend``).
"""

from attnplug.backends.emulators.backends import (
    FA2_EMULATOR,
    FA3_EMULATOR,
    FlashAttn2EmulatedBackend,
    FlashAttn3EmulatedBackend,
    FlashInferEmulatedBackend,
)
from attnplug.backends.emulators.fla_backends import GDNFlaEmulatedBackend
from attnplug.backends.emulators.fla_kernels import FLA_EMULATOR, FlaContractError, FlaEmulator
from attnplug.backends.emulators.mla_backends import FlashInferMLAEmulatedBackend, FlashMLAEmulatedBackend
from attnplug.backends.emulators.mla_kernels import FlashMLAEmulator, MLAContractError
from attnplug.backends.emulators.flash_attn_kernels import FlashAttnContractError, FlashAttnEmulator
from attnplug.backends.emulators.flashinfer_kernels import (
    EMULATED_FLASHINFER,
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    FlashInferContractError,
)

__all__ = [
    "EMULATED_FLASHINFER", "FA2_EMULATOR", "FA3_EMULATOR", "FLA_EMULATOR", "FlaContractError", "FlaEmulator",
    "GDNFlaEmulatedBackend", "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper", "FlashAttn2EmulatedBackend", "FlashAttn3EmulatedBackend",
    "FlashAttnContractError", "FlashAttnEmulator", "FlashInferContractError", "FlashInferEmulatedBackend",
    "FlashInferMLAEmulatedBackend", "FlashMLAEmulatedBackend", "FlashMLAEmulator", "MLAContractError",
]
