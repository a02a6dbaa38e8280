"""``flashmla_sparse``'s REAL impl over the CPU emulator of ``flash_mla_sparse_fwd`` — a
test tool, never registered::

    attnplug check attnplug.backends.emulators.sparse_backends:FlashMLASparseEmulatedBackend

It declares what the emulator takes (float32/float16 too, CPU, any MLA dims), so every sparse
MLA case exercises the lowering (head padding, flat latent rows, int32 indices, base-2 LSE).
"""

from __future__ import annotations

import torch

from attnplug.backends.emulators.sparse_kernels import flash_mla_sparse_fwd
from attnplug.backends.sparse.flashmla.backend import FlashMLASparseBackend
from attnplug.backends.sparse.flashmla.impl import FlashMLASparseImpl


class FlashMLASparseEmulatedImpl(FlashMLASparseImpl):
    @classmethod
    def load_kernel(cls):
        return flash_mla_sparse_fwd


class FlashMLASparseEmulatedBackend(FlashMLASparseBackend):
    """``flashmla_sparse``'s lowering over the emulator."""

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_lora_ranks = None
    supported_qk_rope_head_dims = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "flashmla_sparse_emulated"

    @classmethod
    def get_impl_cls(cls):
        return FlashMLASparseEmulatedImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""
