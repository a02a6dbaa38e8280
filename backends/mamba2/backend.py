"""``Mamba2Backend``: the built-in Mamba2 state backend (torch, optional CUDA kernels)."""

from __future__ import annotations

import torch

from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.mamba import MambaBackend, MambaImpl


class Mamba2Backend(MambaBackend):
    """Mamba2 (SSD) layers over per-request state slots, in plain torch.

    Serves ``"mamba"`` cache groups: one state slot per running request (the group's
    block id), conv state ``[conv_dim, conv_kernel_size - 1]`` and SSM state
    ``[num_heads, head_size, state_size]`` per layer (``MambaStateCache``). Prefill uses
    a varlen causal conv1d and the chunked SSD scan with initial states; decode the
    recurrent update. On CUDA the ``mamba_ssm`` / ``causal_conv1d`` kernels are used
    when importable (``pip install 'attnplug[mamba]'``).

    Capabilities: float32/float16/bfloat16 activations, float32 SSM state, CPU and CUDA,
    conv activation ``silu``.

    Examples:
        >>> Mamba2Backend.get_name(), Mamba2Backend.kv_cache_kind
        ('mamba2_torch', 'mamba')
    """

    supports_draft_verification = True  # verifying rows: backends/mamba2/verify.py

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_ssm_dtypes = (torch.float32,)
    supported_kernel_block_sizes = None
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_name(cls) -> str:
        return "mamba2_torch"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.mamba2.metadata import Mamba2MetadataBuilder
        return Mamba2MetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[MambaImpl]:
        from attnplug.backends.mamba2.impl import Mamba2Impl
        return Mamba2Impl
