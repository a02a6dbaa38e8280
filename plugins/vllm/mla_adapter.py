"""An attnplug MLA backend behind vLLM's MLA impl interface (0.32, 0.33: the same).

vLLM's ``MLAAttention`` layer (``vllm/model_executor/layers/attention/mla_attention.py``)
runs an MLA step itself and calls its backend's impl for three pieces; the bridge maps each
onto the attnplug MLA impl (``attnplug.backends.mla.common.MLACommonImpl``, which every
attnplug MLA backend's impl is):

* ``do_kv_cache_update(kv_c_normed [T, L], k_pe [T, 1, R], kv_cache [num_blocks, block_size,
  L + R], slot_mapping, ...)`` -> the impl's ``write_cache`` (``concat_and_cache_mla``'s
  contract); fp8 caches are refused at construction;
* ``forward_mha(q [T_p, N, P + R], kv_c_normed, k_pe, kv_cache, attn_metadata, k_scale,
  output [T_p, N * V])`` for the prefill rows -> the impl's prefill (new tokens causal,
  then the cached context chunk by chunk through its workspace, merged by LSE);
* ``forward_mqa(q, kv_cache, attn_metadata, layer) -> (o_lat [B, N, L], lse)`` for the decode
  rows, ``q`` the absorbed ``(q_nope W_UK [B, N, L], q_pe [B, N, R])`` (a tuple or their
  concatenation) -> the backend's ``forward_mqa`` over the latent cache. vLLM's layer
  absorbs ``W_UK`` before and applies ``W_UV`` after, from its own ``kv_b_proj``.

The builder is vLLM's interface over the attnplug MLA builder (``reorder_batch_threshold``
1: decodes first, as vLLM orders them); its ``MLAMetadata`` carries the fields vLLM's layer
reads (``num_actual_tokens``, ``num_decodes``, ``num_decode_tokens``, ``num_prefills``,
``decode``, ``prefill``). The impl declares ``supports_dense_mha_prefill = False`` (vLLM
builds no MHA prefill backend of its own for it: prefill is the attnplug impl's).
Refused at construction (``BackendUnsupportedError``): an fp8 / quantized KV cache, a
sliding window, an indexer (sparse MLA), head padding, and any other impl argument.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from attnplug.cache_groups.specs import MLAAttentionSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import BackendUnsupportedError
from attnplug.core.mla import MLALayerConfig
from attnplug.plugins.vllm import _vllm as V
from attnplug.plugins.vllm.metadata import from_vllm


def mla_impl_problems(backend: type, *, kv_cache_dtype: str, sliding_window: int | None, indexer: Any,
                      extra: dict) -> list[str]:
    """Every reason the bridge refuses a vLLM MLA layer for ``backend`` (empty: it serves it)."""
    reasons = []
    if (kv_cache_dtype or "auto") != "auto":
        reasons.append(f"kv_cache_dtype {kv_cache_dtype!r}: the MLA bridge serves unquantized caches only")
    if sliding_window is not None:
        reasons.append(f"sliding window ({sliding_window} tokens) on an MLA layer is not supported")
    if indexer is not None:
        reasons.append("an indexer (sparse MLA, DeepSeek-V3.2) is not translated by the bridge")
    for key in sorted(k for k, v in extra.items() if v is not None):
        reasons.append(f"vLLM MLA impl argument {key!r} is not supported by the bridge")
    return reasons


def bridge_mla_classes(backend: type, vllm_name: str) -> type:
    """The vLLM MLA backend class (``is_mla()`` True) serving attnplug MLA ``backend``."""
    name = backend.get_name()
    builder_cls = _mla_builder(backend)
    impl_cls = _mla_impl(backend, vllm_name)

    class Backend(V.VllmAttentionBackend):
        supported_dtypes = list(backend.supported_dtypes)
        supported_kv_cache_dtypes = ["auto"]
        attnplug_backend = backend

        @staticmethod
        def get_name() -> str:
            return vllm_name

        @staticmethod
        def get_impl_cls():
            return impl_cls

        @staticmethod
        def get_builder_cls():
            return builder_cls

        @classmethod
        def is_mla(cls) -> bool:
            return True

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            sizes = backend.supported_kernel_block_sizes
            return [V.MultipleOf(1)] if sizes is None else list(sizes)

        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return []

    for cls, role in ((builder_cls, "MetadataBuilder"), (impl_cls, "Impl"), (Backend, "Backend")):
        cls.__name__ = cls.__qualname__ = f"Attnplug_{name}_{role}"
        cls.__module__ = "attnplug.plugins.vllm.bridged"
    return Backend


def _mla_builder(backend: type) -> type:
    inner_cls = backend.get_builder_cls()

    class Builder(V.VllmMetadataBuilder):
        _cudagraph_support = V.VllmCGSupport(int(inner_cls.cudagraph_support))
        reorder_batch_threshold = inner_cls.reorder_batch_threshold

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            hf = vllm_config.model_config.hf_text_config
            rope = kv_cache_spec.head_size - hf.kv_lora_rank
            spec = MLAAttentionSpec(block_size=kv_cache_spec.block_size, kv_lora_rank=hf.kv_lora_rank,
                                    qk_rope_head_dim=rope, dtype=kv_cache_spec.dtype)
            sched = vllm_config.scheduler_config
            limits = BuilderConfig(max_num_reqs=sched.max_num_seqs,
                                   max_num_batched_tokens=sched.max_num_batched_tokens,
                                   max_model_len=vllm_config.model_config.max_model_len,
                                   dtype=vllm_config.model_config.dtype)  # the queries' dtype (an fp8 cache's differs)
            self.inner = inner_cls(spec, layer_names, limits, device)

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return self.inner.build(0, from_vllm(common_attn_metadata), fast_build)

    return Builder


def _mla_impl(backend: type, vllm_name: str) -> type:
    name = backend.get_name()

    class Impl(V.VllmMLAImpl):
        supports_dense_mha_prefill = False
        supports_quant_query_input = False
        is_sparse = False

        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                     logits_soft_cap, attn_type, kv_sharing_target_layer_name, q_lora_rank, kv_lora_rank,
                     qk_nope_head_dim, qk_rope_head_dim, qk_head_dim, v_head_dim, kv_b_proj, indexer=None,
                     q_pad_num_heads=None, **extra):
            reasons = mla_impl_problems(backend, kv_cache_dtype=kv_cache_dtype, sliding_window=sliding_window,
                                        indexer=indexer, extra={"q_pad_num_heads": q_pad_num_heads, **extra})
            if reasons:
                raise BackendUnsupportedError(name, reasons, context=f"vLLM (as {vllm_name}, the attnplug bridge)")
            self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
            self.num_kv_heads, self.kv_cache_dtype = 1, kv_cache_dtype
            self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
            self.kv_b_proj = kv_b_proj  # read by the inner impl as layer.kv_b_proj.weight, every call
            self.dcp_world_size, self.pcp_world_size = 1, 1
            config = MLALayerConfig(num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                                    qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                                    dtype=torch.get_default_dtype())
            self.inner = backend.get_impl_cls()(config, scale)

        def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                               skip_scale=False):
            if kv_cache.numel():
                k_pe = k_pe.reshape(k_pe.shape[0], -1)
                self.inner.write_cache(kv_c_normed, k_pe, kv_cache, SimpleNamespace(slot_mapping=slot_mapping))

        def forward_mha(self, q, kv_c_normed, k_pe, kv_cache, attn_metadata, k_scale, output, output_scale=None):
            if output_scale is not None:
                raise BackendUnsupportedError(name, ["fused output quantization (output_scale) not supported"],
                                              context="the vLLM bridge")
            k_pe = k_pe.reshape(k_pe.shape[0], -1)
            out = self.inner._prefill(q, kv_c_normed, k_pe, kv_cache, attn_metadata.prefill, self.inner._kv_b(self))
            output.view(out.shape).copy_(out)

        def forward_mqa(self, q, kv_cache, attn_metadata, layer):
            q_lat = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
            o_lat, lse = self.inner.forward_mqa(q_lat.to(kv_cache.dtype), kv_cache, attn_metadata.decode)
            return o_lat.to(q_lat.dtype), lse

    return Impl
