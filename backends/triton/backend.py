"""``TritonBackend``: attnplug's own paged attention kernels in Triton (GPU, or the
Triton interpreter on the CPU).

Two declarations depend on how the kernels would run *now*, so they are computed on
access (class properties through :class:`_TritonBackendMeta`) rather than frozen at
import: ``supported_devices`` (``"cuda"``, plus ``"cpu"`` under ``TRITON_INTERPRET=1``)
and ``supported_dtypes`` (bfloat16 only when compiling: the interpreter's ``tl.dot``
treats bfloat16 operands as raw ``uint16``, so bfloat16 results would be wrong there).
"""

from __future__ import annotations

from abc import ABCMeta

import torch

from attnplug.backends.common.features import SinksAndAlibiFeatures, WindowAndSoftCapFeatures
from attnplug.backends.triton.constants import FP8_E4M3_MIN_SM, HEAD_SIZES, KERNEL_BLOCK_SIZES
from attnplug.backends.triton.runtime import compute_capability, cuda_available, interpreting, unavailable_reason
from attnplug.core.kv_quant import is_quantized
from attnplug.core.contracts import AttentionBackend, AttentionImpl, AttentionLayerConfig, AttentionMetadataBuilder


class _TritonBackendMeta(ABCMeta):
    """Computes the mode-dependent declarations on access (see the module docstring)."""

    @property
    def supported_devices(cls) -> tuple[str, ...]:
        return ("cuda", "cpu") if interpreting() else ("cuda",)

    @property
    def supported_dtypes(cls) -> tuple[torch.dtype, ...]:
        if interpreting():
            return (torch.float16, torch.float32)
        return (torch.float16, torch.bfloat16, torch.float32)


class TritonBackend(WindowAndSoftCapFeatures, SinksAndAlibiFeatures, AttentionBackend, metaclass=_TritonBackendMeta):
    """Paged varlen attention in Triton: one kernel launch for mixed prefill/decode
    batches, split-KV (segments + reduce) for decode-heavy batches with long contexts.

    Capabilities: float16/bfloat16/float32 (bfloat16 not under the interpreter), head
    sizes that are multiples of 16 up to 256, kernel block sizes 16/32/64, GQA/MQA,
    sliding window, logits soft-cap, decoder (causal) attention; CUDA, or the CPU under
    ``TRITON_INTERPRET=1``. CUDA graphs: ``ALWAYS`` (persistent metadata buffers).

    KV cache per layer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (K at
    index 0 and V at 1 of dim 1, NHD inside a block), the default layout.

    Examples:
        >>> TritonBackend.get_name()
        'triton'
        >>> TritonBackend.get_supported_kernel_block_size(128)
        64
        >>> TritonBackend.get_kv_cache_shape(num_blocks=8, block_size=16, num_kv_heads=2, head_size=64)
        (8, 2, 16, 2, 64)
    """

    supported_head_sizes = HEAD_SIZES
    supported_kernel_block_sizes = KERNEL_BLOCK_SIZES
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_per_head_kv_scales = True

    @classmethod
    def get_name(cls) -> str:
        return "triton"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.triton.builder import TritonMetadataBuilder
        return TritonMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        from attnplug.backends.triton.impl import TritonAttentionImpl
        return TritonAttentionImpl


    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Available when Triton imports and there is a CUDA device or ``TRITON_INTERPRET=1``.
        Cheap (imports triton once); never raises."""
        why = unavailable_reason()
        return (why is None), (why or "")

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig) -> list[str]:
        """The base checks (declared dtypes, head sizes, block sizes, features, device),
        with the reason behind the mode-dependent ones, plus: the KV cache dtype must be
        the activation dtype or an fp8 one, and an ``fp8_e4m3`` cache needs a GPU of compute
        capability >= 8.9 (:data:`~attnplug.backends.triton.constants.FP8_E4M3_MIN_SM`)."""
        reasons = super().validate_configuration(layer)
        dev = torch.device(layer.device).type
        if dev == "cpu" and not interpreting() and cls.is_available()[0]:  # else the base's reason says it
            reasons.append("on the CPU the Triton kernels run only in the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before the first launch (slow; for tests)")
        if layer.dtype == torch.bfloat16 and interpreting():
            reasons.append("bfloat16 is not supported under TRITON_INTERPRET=1: the interpreter's tl.dot "
                           "multiplies bfloat16 operands as raw uint16 bits; use float16/float32 there, or a GPU")
        if layer.effective_kv_cache_dtype != layer.dtype and not is_quantized(layer.effective_kv_cache_dtype):
            reasons.append(f"kv_cache_dtype {layer.effective_kv_cache_dtype} differs from dtype {layer.dtype}: "
                           "the kernels read the cache in the activation dtype (no quantized caches)")
        sm = compute_capability(torch.device(layer.device)) if dev == "cuda" and cuda_available() else None
        if layer.effective_kv_cache_dtype == torch.float8_e4m3fn and sm is not None and sm < FP8_E4M3_MIN_SM:
            reasons.append(f"an fp8_e4m3 KV cache needs compute capability >= {FP8_E4M3_MIN_SM / 10:.1f} (this GPU: "
                           f"{sm / 10:.1f}): Triton cannot convert to float8e4nv there; use fp8_e5m2")
        return reasons
