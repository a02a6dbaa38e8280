"""FlashInfer MLA's builder (one planned wrapper per step) and impl (``wrapper.run``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnplug.backends.common.layer_params import LiveLayerParams
from attnplug.backends.flashinfer.kernels import installed_module
from attnplug.backends.mla.common.builder import MLACommonMetadataBuilder
from attnplug.backends.mla.torch_native.impl import TorchNativeMLAImpl
from attnplug.core.errors import BackendUnsupportedError, MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.mla import MLADecodeMetadata

LIVE_LAYER_PARAMS = LiveLayerParams()
"""Live FlashInfer MLA impls: the builder plans for their head count and scale."""

WORKSPACE_BYTES = 128 * 1024 * 1024
"""FlashInfer's float workspace (its examples allocate 128 MiB); shared by every plan."""


@dataclass(frozen=True)
class FlashInferMLADecodeMetadata(MLADecodeMetadata):
    """:class:`MLADecodeMetadata` plus the wrapper planned for this step's decodes (a new
    wrapper per build, so a plan is never overwritten by a later build: re-entrant)."""

    wrapper: Any = None


class FlashInferMLAMetadataBuilder(MLACommonMetadataBuilder):
    """The common MLA builder plus a planned ``BatchMLAPagedAttentionWrapper`` per step."""

    live_layer_params = LIVE_LAYER_PARAMS
    workspace_bytes = WORKSPACE_BYTES

    @classmethod
    def load_flashinfer(cls) -> Any:
        module = installed_module()
        if module is None:
            raise BackendUnsupportedError("flashinfer_mla", ["flashinfer is not installed"])
        return module

    def build_decode(self, cm: CommonAttentionMetadata, num_decodes: int) -> FlashInferMLADecodeMetadata:
        base = super().build_decode(cm, num_decodes)
        params = self.live_layer_params.for_spec(self.kv_cache_spec)
        if len({(p.num_heads, p.scale) for p in params}) != 1:
            raise MetadataError("FlashInfer MLA plans for one (num_heads, scale); the live impls of this cache group "
                                f"have {sorted({(p.num_heads, p.scale) for p in params}) or 'none'} (create the "
                                "layers' impls before the first build)")
        spec, bs = self.kv_cache_spec, self.kv_cache_spec.block_size
        seq = base.seq_lens.to(torch.int32)
        pages = (seq + bs - 1) // bs
        kv_indptr = torch.zeros(num_decodes + 1, dtype=torch.int32, device=self.device)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        cols = torch.arange(base.block_table.shape[1], device=self.device)
        kv_indices = base.block_table[cols.unsqueeze(0) < pages.unsqueeze(1)].to(torch.int32)
        if not hasattr(self, "_float_workspace"):
            self._float_workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        wrapper = self.load_flashinfer().mla.BatchMLAPagedAttentionWrapper(self._float_workspace)
        wrapper.plan(torch.arange(num_decodes + 1, dtype=torch.int32, device=self.device), kv_indptr, kv_indices, seq,
                     params[0].num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, bs, True, params[0].scale,
                     spec.dtype, spec.dtype)
        return FlashInferMLADecodeMetadata(num_decodes=base.num_decodes, block_table=base.block_table,
                                           seq_lens=base.seq_lens, max_seq_len=base.max_seq_len, wrapper=wrapper)


class FlashInferMLAImpl(TorchNativeMLAImpl):
    """Decode: the planned wrapper's ``run``; prefill: the reference dense MHA."""

    live_layer_params = LIVE_LAYER_PARAMS

    def __init__(self, layer_config, scale):
        super().__init__(layer_config, scale)
        type(self).live_layer_params.add(self)

    def forward_mqa(self, q, kv_cache, decode):
        lr = self.kv_lora_rank
        out, lse = decode.wrapper.run(q[..., :lr].contiguous(), q[..., lr:].contiguous(), kv_cache[..., :lr],
                                      kv_cache[..., lr:], return_lse=True, return_lse_base_on_e=True)
        return out, lse.transpose(0, 1)
