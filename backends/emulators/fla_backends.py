"""``gdn_fla``'s real builder and impl wired to the flash-linear-attention emulator — a test
tool, never registered: ``attnplug.backends.emulators:GDNFlaEmulatedBackend``."""

from __future__ import annotations

from attnplug.backends.emulators.fla_kernels import FLA_EMULATOR
from attnplug.backends.state.gdn.backend import GDNFlaBackend
from attnplug.backends.state.gdn.fla import FlaKernels, GDNFlaImpl


class GDNFlaEmulatedImpl(GDNFlaImpl):
    """The real impl, calling the emulated entry points."""

    @classmethod
    def load_kernels(cls) -> FlaKernels:
        return FLA_EMULATOR.kernels()


class GDNFlaEmulatedBackend(GDNFlaBackend):
    """``gdn_fla``'s builder and impl over the CPU emulator (CPU or CUDA, any dtype)."""

    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "gdn_fla_emulated"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def get_impl_cls(cls):
        return GDNFlaEmulatedImpl
