"""``FlashMLASparseBackend``: sparse MLA through FlashMLA's token-level sparse kernel.

The lowering (``impl.py``) calls ``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v)``
as FlashMLA documents it (``flash_mla_interface.py``): ``q`` ``[s_q, h_q, d_qk]`` bfloat16
with ``h_q`` a multiple of 64 (the lowering zero-pads the heads), ``kv`` ``[s_kv, h_kv = 1,
d_qk]`` (the latent cache viewed flat: one row per slot), ``indices`` ``[s_q, h_kv, topk]``
int32 with ``-1`` for none, ``d_v = 512``; it returns ``(out [s_q, h_q, d_v], max_logits
[s_q, h_q], lse [s_q, h_q])`` with ``lse`` in base 2. ``backends/emulators/sparse_kernels.py``
emulates that contract on the CPU.
"""

from __future__ import annotations

import torch

from attnplug.backends.sparse.flashmla.kernels import load_flash_mla_sparse
from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.sparse import SparseMLABackend, SparseMLAImpl


class FlashMLASparseBackend(SparseMLABackend):
    """FlashMLA sparse consumer (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, bfloat16, CUDA).

    Examples:
        >>> FlashMLASparseBackend.get_name(), FlashMLASparseBackend.sparse
        ('flashmla_sparse', True)
    """

    supported_dtypes = (torch.bfloat16,)
    supported_kernel_block_sizes = None
    supported_kv_lora_ranks = (512,)
    supported_qk_rope_head_dims = (64,)
    supported_devices = ("cuda",)

    @classmethod
    def get_name(cls) -> str:
        return "flashmla_sparse"

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        from attnplug.backends.sparse.common.builders import SparseMLAMetadataBuilder
        return SparseMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[SparseMLAImpl]:
        from attnplug.backends.sparse.flashmla.impl import FlashMLASparseImpl
        return FlashMLASparseImpl

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        fn, why = load_flash_mla_sparse()
        if fn is None:
            return False, why
        if not torch.cuda.is_available():
            return False, "FlashMLA needs a CUDA GPU"
        return True, ""
