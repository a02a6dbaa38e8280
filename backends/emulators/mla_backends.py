"""The FlashMLA and FlashInfer MLA backends' REAL builders and impls over the CPU emulators
of their kernels (``mla_kernels.py``) — test tools, never registered::

    attnplug check attnplug.backends.emulators:FlashMLAEmulatedBackend
    attnplug check attnplug.backends.emulators:FlashInferMLAEmulatedBackend

They declare what the emulators take (float32 too, CPU, any ``kv_lora_rank``), so every
MLA case exercises the lowering; FlashMLA keeps its one page size, 64.
"""

from __future__ import annotations

import torch

from attnplug.backends.emulators.mla_kernels import EMULATED_FLASHINFER_MLA, FlashMLAEmulator
from attnplug.backends.mla.flashinfer_mla.backend import FlashInferMLABackend
from attnplug.backends.mla.flashinfer_mla.impl import FlashInferMLAMetadataBuilder
from attnplug.backends.mla.flashmla.backend import FlashMLABackend
from attnplug.backends.mla.flashmla.impl import FlashMLAMetadataBuilder

FLASH_MLA_EMULATOR = FlashMLAEmulator()
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FlashMLAEmulatedBuilder(FlashMLAMetadataBuilder):
    @classmethod
    def load_kernels(cls):
        return FLASH_MLA_EMULATOR


class FlashMLAEmulatedBackend(FlashMLABackend):
    """``flashmla``'s builder and impl over the FlashMLA emulator."""

    supported_dtypes = _DTYPES
    supported_kv_lora_ranks = None
    supported_qk_rope_head_dims = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "flashmla_emulated"

    @classmethod
    def get_builder_cls(cls):
        return FlashMLAEmulatedBuilder

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""


class FlashInferMLAEmulatedBuilder(FlashInferMLAMetadataBuilder):
    workspace_bytes = 1024

    @classmethod
    def load_flashinfer(cls):
        return EMULATED_FLASHINFER_MLA


class FlashInferMLAEmulatedBackend(FlashInferMLABackend):
    """``flashinfer_mla``'s builder and impl over the emulated wrapper."""

    supported_dtypes = _DTYPES
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "flashinfer_mla_emulated"

    @classmethod
    def get_builder_cls(cls):
        return FlashInferMLAEmulatedBuilder

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""
