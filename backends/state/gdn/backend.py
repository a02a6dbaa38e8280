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
