"""Backends that pair the REAL ``flash_attn`` / ``flashinfer`` builders with impls calling
the CPU emulators of the kernels — test tools, never registered, never selectable.

They exist so the conformance suite (and ``attnplug check``) can check on a CPU that
the builders lower a step into exactly the arguments the kernels' contracts require::

    attnplug check attnplug.backends.emulators:FlashAttn3EmulatedBackend
    attnplug check attnplug.backends.emulators:FlashInferEmulatedBackend

Everything but the kernel call is the production code: the builder (persistent buffers,
cascade fields, page metadata, planning), the impl (K/V write, argument passing,
decode/prefill slicing). The emulated classes declare what the emulators support, which
is wider than the real kernels (float32, any head size, CPU), so every case of the suite
exercises the lowering; the real backends keep their real declarations.
"""

from __future__ import annotations

import torch

from attnplug.backends.emulators.flash_attn_kernels import FlashAttnEmulator
from attnplug.backends.emulators.flashinfer_kernels import EMULATED_FLASHINFER
from attnplug.backends.flash_attn.backend import FlashAttnBackend
from attnplug.backends.flash_attn.builder import FlashAttnMetadataBuilder
from attnplug.backends.flash_attn.impl import FlashAttnImpl
from attnplug.backends.flash_attn.kernels import FlashAttnKernels
from attnplug.backends.flashinfer.backend import FlashInferBackend
from attnplug.backends.flashinfer.builder import FlashInferMetadataBuilder
from attnplug.backends.flashinfer.impl import FlashInferImpl

FA2_EMULATOR = FlashAttnEmulator(version=2)
"""The emulated FlashAttention 2 entry points (with their call log) the FA2 classes use."""
FA3_EMULATOR = FlashAttnEmulator(version=3)
"""The emulated FlashAttention 3 entry points (with their call log) the FA3 classes use."""

_EMULATED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- FlashAttention ---------------------------------------------------------------------
class FlashAttn3EmulatedBuilder(FlashAttnMetadataBuilder):
    """The real builder, planning for the emulated FlashAttention 3."""

    emulator = FA3_EMULATOR

    @classmethod
    def load_kernels(cls) -> FlashAttnKernels:
        return cls.emulator.kernels()

    @classmethod
    def kernels_version(cls) -> int:
        return cls.emulator.version


class FlashAttn3EmulatedImpl(FlashAttnImpl):
    """The real impl, calling the emulated FlashAttention 3."""

    backend_name = "flash_attn3_emulated"
    emulator = FA3_EMULATOR

    @classmethod
    def load_kernels(cls) -> FlashAttnKernels:
        return cls.emulator.kernels()


class FlashAttn2EmulatedBuilder(FlashAttn3EmulatedBuilder):
    emulator = FA2_EMULATOR


class FlashAttn2EmulatedImpl(FlashAttn3EmulatedImpl):
    backend_name = "flash_attn2_emulated"
    emulator = FA2_EMULATOR


class FlashAttn3EmulatedBackend(FlashAttnBackend):
    """``flash_attn``'s builder and impl over the FlashAttention 3 emulator (any page size)."""

    supported_dtypes = _EMULATED_DTYPES
    supported_head_sizes = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "flash_attn3_emulated"

    @classmethod
    def kernels_version(cls) -> int:
        return 3

    @classmethod
    def get_builder_cls(cls):
        return FlashAttn3EmulatedBuilder

    @classmethod
    def get_impl_cls(cls):
        return FlashAttn3EmulatedImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""


class FlashAttn2EmulatedBackend(FlashAttn3EmulatedBackend):
    """``flash_attn``'s builder and impl over the FlashAttention 2 emulator (pages of 256k)."""

    @classmethod
    def get_name(cls) -> str:
        return "flash_attn2_emulated"

    @classmethod
    def kernels_version(cls) -> int:
        return 2

    @classmethod
    def get_builder_cls(cls):
        return FlashAttn2EmulatedBuilder

    @classmethod
    def get_impl_cls(cls):
        return FlashAttn2EmulatedImpl


# --- FlashInfer -------------------------------------------------------------------------
class FlashInferEmulatedBuilder(FlashInferMetadataBuilder):
    """The real builder, planning the emulated wrappers."""

    workspace_bytes = 1024

    @classmethod
    def load_flashinfer(cls):
        return EMULATED_FLASHINFER


class FlashInferEmulatedBackend(FlashInferBackend):
    """``flashinfer``'s builder and impl over the emulated wrappers."""

    supported_dtypes = _EMULATED_DTYPES
    supported_head_sizes = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "flashinfer_emulated"

    @classmethod
    def get_builder_cls(cls):
        return FlashInferEmulatedBuilder

    @classmethod
    def get_impl_cls(cls):
        return FlashInferImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""
