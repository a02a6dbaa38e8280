"""FlashMLA's builder (plans ``get_mla_metadata`` per step) and impl (``flash_mla_with_kvcache``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from attnplug.backends.common.layer_params import LiveLayerParams
from attnplug.backends.mla.common.builder import MLACommonMetadataBuilder
from attnplug.backends.mla.flashmla.kernels import load_flash_mla
from attnplug.backends.mla.torch_native.impl import TorchNativeMLAImpl
from attnplug.core.errors import BackendUnsupportedError, MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.core.mla import MLADecodeMetadata

LIVE_LAYER_PARAMS = LiveLayerParams()
"""Live FlashMLA impls: the builder plans for their query-head count."""


@dataclass(frozen=True)
class FlashMLADecodeMetadata(MLADecodeMetadata):
    """:class:`MLADecodeMetadata` plus FlashMLA's plan for this step's decodes."""

    tile_scheduler_metadata: torch.Tensor | None = None
    """``[num_sm_parts, 8]``, ``torch.int32`` (``get_mla_metadata``)."""
    num_splits: torch.Tensor | None = None
    """``[num_decodes + 1]``, ``torch.int32`` (``get_mla_metadata``)."""
    kernels: SimpleNamespace | None = None
    """The FlashMLA entry points the plan was made with (the impl calls the same)."""


class FlashMLAMetadataBuilder(MLACommonMetadataBuilder):
    """The common MLA builder plus FlashMLA's per-step tile plan for the decodes."""

    live_layer_params = LIVE_LAYER_PARAMS

    @classmethod
    def load_kernels(cls) -> SimpleNamespace:
        kernels, why = load_flash_mla()
        if kernels is None:
            raise BackendUnsupportedError("flashmla", [why])
        return kernels

    def build_decode(self, cm: CommonAttentionMetadata, num_decodes: int) -> FlashMLADecodeMetadata:
        base = super().build_decode(cm, num_decodes)
        heads = {p.num_heads for p in self.live_layer_params.for_spec(self.kv_cache_spec)}
        if len(heads) != 1:
            raise MetadataError(f"FlashMLA plans for one query-head count; the live impls of this cache group have "
                                f"{sorted(heads) or 'none'} (create the layers' impls before the first build)")
        kernels = self.load_kernels()
        tile, splits = kernels.get_mla_metadata(base.seq_lens, heads.pop(), 1)
        return FlashMLADecodeMetadata(num_decodes=base.num_decodes, block_table=base.block_table,
                                      seq_lens=base.seq_lens, max_seq_len=base.max_seq_len,
                                      tile_scheduler_metadata=tile, num_splits=splits, kernels=kernels)


class FlashMLAImpl(TorchNativeMLAImpl):
    """Decode: ``flash_mla_with_kvcache``; prefill: the reference dense MHA."""

    live_layer_params = LIVE_LAYER_PARAMS

    def __init__(self, layer_config, scale):
        super().__init__(layer_config, scale)
        type(self).live_layer_params.add(self)

    def forward_mqa(self, q, kv_cache, decode):
        out, lse = decode.kernels.flash_mla_with_kvcache(
            q.unsqueeze(1), kv_cache.unsqueeze(2), decode.block_table, decode.seq_lens, self.kv_lora_rank,
            decode.tile_scheduler_metadata, decode.num_splits, softmax_scale=self.scale, causal=True)
        lse = lse[:, :, 0].transpose(0, 1)                                  # [B, H, 1] -> [H, B]
        return out[:, 0], lse.masked_fill(lse == float("inf"), float("-inf"))
