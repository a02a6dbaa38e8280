"""``GDNTorchBackend`` (``gdn_torch``): the built-in Gated DeltaNet state backend, plain torch."""

from __future__ import annotations

import torch

from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.gdn import GDNBackend, GDNImpl


class GDNTorchBackend(GDNBackend):
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over per-request state slots, in plain torch.

    Serves ``"mamba"`` (state) cache groups whose spec declares ``state_kind = "gdn"``:
    per layer a conv state ``[conv_dim, conv_kernel_size - 1]`` and a float32 recurrent
    state ``[num_v_heads, head_k_dim, head_v_dim]`` (``GDNStateCache``). Prefill: varlen
    causal conv1d and the chunked gated delta rule with initial states; decode: the
    recurrent step.

    Capabilities: float32/float16/bfloat16 activations, float32 state, CPU and CUDA, conv
    activation ``silu``.

    Examples:
        >>> GDNTorchBackend.get_name(), GDNTorchBackend.kv_cache_kind, GDNTorchBackend.state_kind
        ('gdn_torch', 'mamba', 'gdn')
    """

    supports_draft_verification = True  # verifying rows: GDNTorchImpl._verify (backends/mamba2/verify.py layout)

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kernel_block_sizes = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "gdn_torch"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.state.gdn.metadata import GDNMetadataBuilder
        return GDNMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[GDNImpl]:
        from attnplug.backends.state.gdn.impl import GDNTorchImpl
        return GDNTorchImpl


class _GDNTritonMeta(type(GDNBackend)):
    """Computes the mode-dependent declarations on access, as ``TritonBackend`` does: CPU only
    under the Triton interpreter, no bfloat16 there."""

    @property
    def supported_devices(cls) -> tuple[str, ...]:
        from attnplug.backends.triton.runtime import interpreting
        return ("cuda", "cpu") if interpreting() else ("cuda",)

    @property
    def supported_dtypes(cls) -> tuple[torch.dtype, ...]:
        from attnplug.backends.triton.runtime import interpreting
        return (torch.float16, torch.float32) if interpreting() else (torch.float16, torch.bfloat16, torch.float32)


class GDNTritonBackend(GDNBackend, metaclass=_GDNTritonMeta):
    """``gdn_triton``: :class:`GDNTorchBackend` with the gated delta rule in a Triton kernel
    (the fused recurrence over packed sequences, one program per sequence and value head).

    Runs compiled on CUDA, or on the CPU in the Triton interpreter (``TRITON_INTERPRET=1``
    before the first ``import triton``; float16/float32 there).
    """

    supports_draft_verification = True  # verifying rows: the Triton rule one position at a time

    supported_kernel_block_sizes = None

    @classmethod
    def get_name(cls) -> str:
        return "gdn_triton"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        from attnplug.backends.triton.runtime import unavailable_reason
        why = unavailable_reason()
        return (True, "") if why is None else (False, why)

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.state.gdn.metadata import GDNMetadataBuilder
        return GDNMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[GDNImpl]:
        from attnplug.backends.state.gdn.impl import GDNTritonImpl
        return GDNTritonImpl


class GDNFlaBackend(GDNBackend):
    """``gdn_fla``: the GDN rule in flash-linear-attention's kernels (``chunk_gated_delta_rule``
    for prefill, ``fused_recurrent_gated_delta_rule`` for decode; CUDA, ``pip install
    flash-linear-attention``); builder and conv as ``gdn_torch``. Tested on CPU through
    ``attnplug.backends.emulators:GDNFlaEmulatedBackend``."""

    supports_draft_verification = True  # verifying rows: fused_recurrent_gated_delta_rule per position

    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supported_kernel_block_sizes = None
    supported_devices = ("cuda",)

    @classmethod
    def get_name(cls) -> str:
        return "gdn_fla"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        from attnplug.backends.state.gdn.fla import load_fla_kernels
        if not torch.cuda.is_available():
            return False, "flash-linear-attention needs a CUDA device"
        if load_fla_kernels() is None:
            return False, "flash-linear-attention is not installed (pip install flash-linear-attention)"
        return True, ""

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.state.gdn.metadata import GDNMetadataBuilder
        return GDNMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[GDNImpl]:
        from attnplug.backends.state.gdn.fla import GDNFlaImpl
        return GDNFlaImpl
