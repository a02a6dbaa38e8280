"""``FlashInferMLABackend``: decode with FlashInfer's ``BatchMLAPagedAttentionWrapper``
(planned once per step, run per layer); prefill with the reference dense MHA.

``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)`` then
``run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True, return_lse_base_on_e=True)``
with the cache split into its latent (``ckv``) and rope (``kpe``) views. Facts from
flashinfer-python 0.6.18's ``flashinfer/mla``; ``backends/emulators/mla_kernels.py``
emulates them.
"""

from __future__ import annotations

import torch

from attnplug.backends.flashinfer.kernels import INSTALL_HINT, installed_module
from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.mla import MLABackend, MLAImpl


class FlashInferMLABackend(MLABackend):
    """FlashInfer MLA decode (float16/bfloat16, CUDA, any page size).

    Examples:
        >>> FlashInferMLABackend.get_name()
        'flashinfer_mla'
    """

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kernel_block_sizes = None
    supported_devices = ("cuda",)

    @classmethod
    def get_name(cls) -> str:
        return "flashinfer_mla"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.mla.flashinfer_mla.impl import FlashInferMLAMetadataBuilder
        return FlashInferMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[MLAImpl]:
        from attnplug.backends.mla.flashinfer_mla.impl import FlashInferMLAImpl
        return FlashInferMLAImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        module = installed_module()
        if module is None or not hasattr(getattr(module, "mla", None), "BatchMLAPagedAttentionWrapper"):
            return False, f"flashinfer with flashinfer.mla.BatchMLAPagedAttentionWrapper is not installed ({INSTALL_HINT})"
        if not torch.cuda.is_available():
            return False, "FlashInfer MLA needs a CUDA GPU"
        return True, ""
