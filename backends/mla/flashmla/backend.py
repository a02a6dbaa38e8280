"""``FlashMLABackend``: decode with FlashMLA's ``flash_mla_with_kvcache``; prefill with
the reference dense MHA (``torch_native_mla``'s ``forward_mha``).

FlashMLA is planned once per step: ``get_mla_metadata(cache_seqlens, seq_len_q *
num_heads_q // num_heads_k, num_heads_k)`` splits the decodes' keys over the SMs
(``tile_scheduler_metadata``, ``num_splits``); every layer then calls
``flash_mla_with_kvcache`` with those. Pages are 64 tokens. Facts from FlashMLA's
``flash_mla_interface.py`` docstrings; ``backends/emulators/mla_kernels.py`` emulates them.
"""

from __future__ import annotations

import torch

from attnplug.backends.mla.flashmla.kernels import load_flash_mla
from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.mla import MLABackend, MLAImpl


class FlashMLABackend(MLABackend):
    """FlashMLA decode (block size 64, ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64,
    float16/bfloat16, CUDA).

    Examples:
        >>> FlashMLABackend.get_name(), FlashMLABackend.supported_kernel_block_sizes
        ('flashmla', (64,))
    """

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kernel_block_sizes = (64,)
    supported_kv_lora_ranks = (512,)
    supported_qk_rope_head_dims = (64,)
    supported_devices = ("cuda",)

    @classmethod
    def get_name(cls) -> str:
        return "flashmla"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.mla.flashmla.impl import FlashMLAMetadataBuilder
        return FlashMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[MLAImpl]:
        from attnplug.backends.mla.flashmla.impl import FlashMLAImpl
        return FlashMLAImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        kernels, why = load_flash_mla()
        if kernels is None:
            return False, why
        if not torch.cuda.is_available():
            return False, "FlashMLA needs a CUDA GPU"
        return True, ""
