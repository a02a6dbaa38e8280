"""Attention backends, one sub-package each.

Backends are found through the plugin registry (``attnplug.plugins``), never by
importing a backend package directly. :data:`BUILTIN_BACKENDS` lists the built-in
ones as ``"module:Class"`` paths; the built-in plugin (``attnplug.plugins.builtin``)
registers them through the same hook third-party plugins use. To look a backend up
by name, use :func:`attnplug.plugins.get_backend`. This package imports nothing of
``attnplug.plugins``.
"""

from __future__ import annotations

BUILTIN_BACKENDS: dict[str, str] = {
    "torch_native": "attnplug.backends.torch_native.backend:TorchNativeBackend",
    "cpu_sdpa": "attnplug.backends.cpu_sdpa.backend:CpuSdpaBackend",
    "mamba2_torch": "attnplug.backends.mamba2.backend:Mamba2Backend",
    "gdn_torch": "attnplug.backends.state.gdn.backend:GDNTorchBackend",
    "gdn_triton": "attnplug.backends.state.gdn.backend:GDNTritonBackend",
    "gdn_fla": "attnplug.backends.state.gdn.backend:GDNFlaBackend",
    "triton": "attnplug.backends.triton.backend:TritonBackend",
    "flash_attn": "attnplug.backends.flash_attn.backend:FlashAttnBackend",
    "flashinfer": "attnplug.backends.flashinfer.backend:FlashInferBackend",
    "torch_native_mla": "attnplug.backends.mla.torch_native.backend:TorchNativeMLABackend",
    "triton_mla": "attnplug.backends.mla.triton.backend:TritonMLABackend",
    "flashmla": "attnplug.backends.mla.flashmla.backend:FlashMLABackend",
    "flashinfer_mla": "attnplug.backends.mla.flashinfer_mla.backend:FlashInferMLABackend",
    "torch_native_indexer": "attnplug.backends.sparse.torch_native.backend:TorchNativeIndexerBackend",
    "torch_native_sparse_mla": "attnplug.backends.sparse.torch_native.backend:TorchNativeSparseMLABackend",
    "triton_indexer": "attnplug.backends.sparse.triton.backend:TritonIndexerBackend",
    "triton_sparse_mla": "attnplug.backends.sparse.triton.backend:TritonSparseMLABackend",
    "flashmla_sparse": "attnplug.backends.sparse.flashmla.backend:FlashMLASparseBackend",
}
"""Built-in backend name -> ``"module:ClassName"`` of its
:class:`~attnplug.core.contracts.AttentionBackend`.

Each module must import without the backend's optional packages (the class reports
whether it can run through ``is_available()``)."""


__all__ = ["BUILTIN_BACKENDS"]
