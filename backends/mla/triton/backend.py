"""``TritonMLABackend``: MLA with Triton kernels (GPU, or the interpreter on the CPU).

Declarations that depend on the Triton mode are computed on access, as for the
``triton`` backend: ``supported_devices`` (``"cpu"`` only under ``TRITON_INTERPRET=1``)
and ``supported_dtypes`` (no bfloat16 under the interpreter, whose bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

from abc import ABCMeta
from typing import Any

import torch

from attnplug.backends.triton.constants import KERNEL_BLOCK_SIZES, MAX_HEAD_SIZE
from attnplug.backends.triton.runtime import interpreting, unavailable_reason
from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.mla import MLABackend, MLAImpl


class _TritonMLAMeta(ABCMeta):
    @property
    def supported_devices(cls) -> tuple[str, ...]:
        return ("cuda", "cpu") if interpreting() else ("cuda",)

    @property
    def supported_dtypes(cls) -> tuple[torch.dtype, ...]:
        if interpreting():
            return (torch.float16, torch.float32)
        return (torch.float16, torch.bfloat16, torch.float32)


class TritonMLABackend(MLABackend, metaclass=_TritonMLAMeta):
    """Triton MLA: decode = ``mla_decode_kernel`` (paged latent, split-KV); prefill = the
    ``triton`` backend's varlen paged kernel over up-projected keys and values.

    Capabilities: float16/float32 (+ bfloat16 compiled), kernel block sizes 16/32/64, any
    ``kv_lora_rank`` / ``qk_rope_head_dim``; the prefill's q/k head size
    ``qk_nope_head_dim + qk_rope_head_dim`` must be a multiple of 16 up to 256 and
    ``v_head_dim`` at most that (values are zero-padded to it). Cache: ``[num_blocks,
    block_size, kv_lora_rank + qk_rope_head_dim]``.

    Examples:
        >>> TritonMLABackend.get_name(), TritonMLABackend.get_supported_kernel_block_size(128)
        ('triton_mla', 64)
    """

    supported_kernel_block_sizes = KERNEL_BLOCK_SIZES

    @classmethod
    def get_name(cls) -> str:
        return "triton_mla"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.mla.triton.builder import TritonMLAMetadataBuilder
        return TritonMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[MLAImpl]:
        from attnplug.backends.mla.triton.impl import TritonMLAImpl
        return TritonMLAImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        why = unavailable_reason()
        return (why is None, why or "")

    @classmethod
    def validate_configuration(cls, layer: Any) -> list[str]:
        reasons = super().validate_configuration(layer)
        qk = getattr(layer, "qk_head_dim", None)
        if qk is not None and (qk % 16 or not 0 < qk <= MAX_HEAD_SIZE):
            reasons.append(f"qk_nope_head_dim + qk_rope_head_dim = {qk} is not a multiple of 16 in "
                           f"[16, {MAX_HEAD_SIZE}] (the prefill kernel's head size)")
        v = getattr(layer, "v_head_dim", None)
        if qk is not None and v is not None and v > qk:
            reasons.append(f"v_head_dim {v} > qk_nope_head_dim + qk_rope_head_dim {qk}")
        return reasons
