"""vLLM ``AttentionBackend`` / builder / impl classes around one attnplug backend, written
once for every supported minor (0.32, 0.33): the names come from the minor's adapter
package through ``_vllm``.

``bridge_classes(attnplug_backend, vllm_name)`` returns the vLLM backend class; vLLM finds
it by class path (``attnplug.plugins.vllm.bridged.selected``, see ``bridged.py``).

What maps to what:

* capabilities: dtypes, head sizes, sliding window, GQA -> vLLM's ``supported_dtypes``,
  ``get_supported_head_sizes``, ``supports_sliding_window``; kernel block sizes ->
  ``get_supported_kernel_block_sizes`` (attnplug's ``None`` -> ``MultipleOf(1)``); KV
  cache dtype ``"auto"`` only; decoder attention only; CUDA graphs: the attnplug
  builder's ``cudagraph_support`` level, same numbering.
* metadata: ``metadata.from_vllm`` (costs documented there), then the attnplug builder.
* KV cache: ``kv_layout`` (zero-copy view; block-compact layouts declared).
* MLA backends (dense): vLLM's MLA impl interface (``forward_mha`` / ``forward_mqa``,
  ``mla_adapter.py``).
* refused when the class is built (``BackendUnsupportedError``): a sparse MLA backend, a
  sparse selector (indexer), a state backend -- each with the vLLM interface it would need.
* attention sinks: vLLM's ``sinks`` impl argument (the model's ``[num_heads]`` parameter)
  reaches the attnplug impl as one persistent float32 buffer (``AttentionImpl(sinks=)``),
  refreshed in place (``copy_``) before each forward because vLLM loads weights after
  building the impl; refused for a backend whose
  ``supports_sink()`` is False.
* fp8 KV caches: vLLM's ``kv_cache_dtype`` ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` where the
  attnplug backend declares the matching ``supported_kv_cache_dtypes``: vLLM's ``uint8`` cache
  is viewed as the fp8 dtype and the layer's per-tensor ``_k_scale`` / ``_v_scale`` reach the
  impl as ``k_scale`` / ``v_scale`` (``_VllmScales``).
* refused at construction with the reason (``BackendUnsupportedError``): ALiBi, an fp8 cache
  the backend does not declare, KV sharing, a soft cap or window the attnplug backend
  does not declare, non-decoder attention; at forward: fused output quantization
  (``output_scale`` / ``output_block_scale``), which vLLM only asks of impls that say
  ``fused_output_quant_supported`` (these say no).
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import BackendUnsupportedError
from attnplug.core.kv_quant import parse_kv_cache_dtype
from attnplug.plugins.vllm import _vllm as V
from attnplug.plugins.vllm.kv_layout import attnplug_view, layout_problem
from attnplug.plugins.vllm.metadata import from_vllm


def _attnplug_spec(spec: Any):
    """attnplug's spec for vLLM's group spec (a vLLM ``SlidingWindowSpec`` -> a window group)."""
    fields = dict(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                  dtype=spec.dtype)
    window = spec.sliding_window if isinstance(spec, V.VllmSlidingWindowSpec) else None
    return SlidingWindowSpec(sliding_window=window, **fields) if window else FullAttentionSpec(**fields)


VLLM_KV_CACHE_DTYPES: dict[str, str] = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
                                         "fp8_e5m2": "fp8_e5m2"}
"""vLLM's ``kv_cache_dtype`` strings -> attnplug's ``--kv-cache-dtype`` names (vLLM's ``"fp8"``
means e4m3, ``vllm/utils/torch_utils.py``). vLLM allocates an fp8 cache as ``torch.uint8``;
the bridge views it as the fp8 dtype (same element size, no copy)."""


def _vllm_kv_dtypes(backend: type) -> list[str]:
    """The vLLM ``kv_cache_dtype`` strings ``backend`` serves through the bridge."""
    return [name for name, ours in VLLM_KV_CACHE_DTYPES.items() if ours in backend.supported_kv_cache_dtypes]


class _VllmScales:
    """What an attnplug impl reads from its ``layer`` argument for an fp8 cache
    (``core/kv_quant.layer_kv_scales``): vLLM's ``Attention`` keeps its per-tensor descales as
    float32 ``[]`` tensors ``_k_scale`` / ``_v_scale`` (real = stored * scale, attnplug's
    convention too)."""

    __slots__ = ("k_scale", "v_scale")

    def __init__(self, layer):
        self.k_scale = getattr(layer, "_k_scale", None)
        self.v_scale = getattr(layer, "_v_scale", None)


def impl_problems(backend: type, *, num_heads: int, num_kv_heads: int, head_size: int, alibi_slopes: Any,
                  sliding_window: int | None, kv_cache_dtype: str, logits_soft_cap: float | None,
                  attn_type: str, kv_sharing_target_layer_name: str | None, extra: dict) -> list[str]:
    """Every reason the bridge refuses a vLLM layer for ``backend`` (empty: it serves it)."""
    reasons = []
    if alibi_slopes is not None:
        reasons.append("ALiBi slopes are not part of the attnplug contract")
    sinks = extra.get("sinks")
    if sinks is not None and not backend.supports_sink():
        reasons.append(f"attention sinks not supported by {backend.get_name()} (supports_sink() is False)")
    elif sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,)):
        reasons.append(f"sinks must be a [{num_heads}] tensor (one logit per query head), got "
                       f"{getattr(sinks, 'shape', type(sinks).__name__)}")
    for key in sorted(k for k, v in extra.items() if k != "sinks" and v is not None):
        reasons.append(f"vLLM impl argument {key!r} is not supported by the bridge")
    kv = VLLM_KV_CACHE_DTYPES.get(kv_cache_dtype or "auto")
    if kv is None:
        reasons.append(f"kv_cache_dtype {kv_cache_dtype!r} not supported by the bridge (it serves "
                       f"{', '.join(VLLM_KV_CACHE_DTYPES)})")
    elif kv not in backend.supported_kv_cache_dtypes:
        reasons.append(f"kv_cache_dtype {kv_cache_dtype!r} ({kv}) not supported by {backend.get_name()} "
                       f"(supported_kv_cache_dtypes: {', '.join(backend.supported_kv_cache_dtypes)})")
    if kv_sharing_target_layer_name is not None:
        reasons.append(f"KV sharing (with layer {kv_sharing_target_layer_name!r}) not supported")
    if attn_type != V.VllmAttentionType.DECODER:
        reasons.append(f"attention type {attn_type!r} not supported (decoder only)")
    if sliding_window is not None and not backend.supports_sliding_window():
        reasons.append(f"sliding window ({sliding_window} tokens) not supported by {backend.get_name()}")
    if logits_soft_cap is not None and not backend.supports_logits_soft_cap():
        reasons.append(f"logits soft cap ({logits_soft_cap}) not supported by {backend.get_name()}")
    if num_heads != num_kv_heads and not backend.supports_mqa_gqa():
        reasons.append(f"GQA ({num_heads} heads / {num_kv_heads} KV heads) not supported by {backend.get_name()}")
    why = layout_problem(backend, 16, num_kv_heads, head_size)
    if why:
        reasons.append(why)
    return reasons


def bridge_classes(backend: type, vllm_name: str) -> type:
    """The vLLM backend class serving attnplug ``backend`` under vLLM name ``vllm_name``.

    Three classes, named ``Attnplug_<name>_{MetadataBuilder,Impl,Backend}`` in module
    ``attnplug.plugins.vllm.bridged``: the builder and impl wrap attnplug's own, the backend
    class answers vLLM's selection and layout questions from ``backend``'s declarations.
    """
    name = backend.get_name()
    if backend.kv_cache_kind == "mla" and not getattr(backend, "sparse", False):
        from attnplug.plugins.vllm.mla_adapter import bridge_mla_classes

        return bridge_mla_classes(backend, vllm_name)
    if backend.kv_cache_kind != "attention":
        raise BackendUnsupportedError(name, [_unbridged_kind_reason(backend.kv_cache_kind)],
                                      context=f"vLLM (as {vllm_name}, the attnplug bridge)")
    builder_cls = _bridged_builder(backend)
    impl_cls = _bridged_impl(backend, vllm_name)
    backend_cls = _bridged_backend(backend, vllm_name, impl_cls, builder_cls)
    for cls, role in ((builder_cls, "MetadataBuilder"), (impl_cls, "Impl"), (backend_cls, "Backend")):
        cls.__name__ = cls.__qualname__ = f"Attnplug_{name}_{role}"
        cls.__module__ = "attnplug.plugins.vllm.bridged"
    return backend_cls


_UNBRIDGED_KINDS = {  # "mla" reaches here only for a sparse MLA backend
    "mla": "a sparse MLA backend (DeepSeek-V3.2: attends to an indexer's top-k): vLLM drives it through its "
           "sparse MLA layer and indexer backend, which the bridge does not translate (dense MLA backends are "
           "translated: plugins/vllm/mla_adapter.py; docs/vllm.md)",
    "indexer": "a sparse-attention selector (indexer): vLLM keeps its DeepSeek-V3.2 indexer as a backend of its "
               "own, which the bridge does not translate (docs/vllm.md)",
    "mamba": "a state backend (Mamba2 / GDN): vLLM selects state backends from its own MambaAttentionBackendEnum "
             "(MAMBA1, MAMBA2, SHORT_CONV, LINEAR, GDN_ATTN), not AttentionBackendEnum, and the model's layer, its "
             "MambaSpec KV manager and the conv / SSM state tensors it allocates fix the state layout and the "
             "metadata; the bridge does not translate them (docs/vllm.md)",
}


def _unbridged_kind_reason(kind: str) -> str:
    """Why the bridge refuses a backend of cache kind ``kind`` (it serves ``"attention"`` and dense ``"mla"``)."""
    what = _UNBRIDGED_KINDS.get(kind, f"a backend of cache kind {kind!r}: the bridge serves attention backends only")
    return f"{what}; the bridge serves paged-attention backends (kv_cache_kind 'attention') and dense MLA only"


def _bridged_builder(backend: type) -> type:
    """vLLM's metadata-builder interface over ``backend``'s builder (vLLM metadata translated once)."""

    class Builder(V.VllmMetadataBuilder):
        _cudagraph_support = V.VllmCGSupport(int(backend.get_builder_cls().cudagraph_support))
        reorder_batch_threshold = backend.get_builder_cls().reorder_batch_threshold

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            sched = vllm_config.scheduler_config
            limits = BuilderConfig(max_num_reqs=sched.max_num_seqs,
                                   max_num_batched_tokens=sched.max_num_batched_tokens,
                                   max_model_len=vllm_config.model_config.max_model_len,
                                   dtype=vllm_config.model_config.dtype)  # the queries' dtype (an fp8 cache's differs)
            self.inner = backend.get_builder_cls()(_attnplug_spec(kv_cache_spec), layer_names, limits,
                                                   device)

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return self.inner.build(0, from_vllm(common_attn_metadata), fast_build)

    return Builder


def _bridged_impl(backend: type, vllm_name: str) -> type:
    """vLLM's attention-impl interface over ``backend``'s impl; refuses what it cannot serve."""
    name = backend.get_name()

    class Impl(V.VllmAttentionImpl):
        def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                     sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                     attn_type=V.VllmAttentionType.DECODER, kv_sharing_target_layer_name=None, **extra):
            num_kv_heads = num_kv_heads or num_heads
            reasons = impl_problems(backend, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                                    alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                                    kv_cache_dtype=kv_cache_dtype, logits_soft_cap=logits_soft_cap,
                                    attn_type=attn_type, kv_sharing_target_layer_name=kv_sharing_target_layer_name,
                                    extra=extra)
            if reasons:
                raise BackendUnsupportedError(name, reasons, context=f"vLLM (as {vllm_name}, the attnplug bridge)")
            self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
            self.num_kv_heads, self.sliding_window = num_kv_heads, sliding_window
            self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type
            self.cache_dtype = parse_kv_cache_dtype(VLLM_KV_CACHE_DTYPES[kv_cache_dtype or "auto"])
            self.logits_soft_cap, self.kv_sharing_target_layer_name = logits_soft_cap, None
            # vLLM's sinks are the model's parameter (its dtype, loaded after this constructor):
            # the inner impl holds one float32 [num_heads] buffer, refreshed in place (copy_)
            # before each forward; re-made only if the parameter moves to another device
            self.sinks = extra.get("sinks")
            sinks32 = None if self.sinks is None else torch.zeros(num_heads, dtype=torch.float32,
                                                                  device=self.sinks.device)
            self.sinks32 = sinks32
            self.inner = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads,
                                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                                kv_cache_dtype=self.cache_dtype,
                                                **({} if sinks32 is None else {"sinks": sinks32}))

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            if output_scale is not None or output_block_scale is not None:
                raise BackendUnsupportedError(name, ["fused output quantization (output_scale) not supported"],
                                              context="the vLLM bridge")
            if attn_metadata is None:  # vLLM's profiling run: no metadata, nothing to attend
                return output
            if self.sinks is not None:
                if self.sinks32.device != query.device:  # the model moved after construction: once
                    self.sinks32 = torch.zeros_like(self.sinks32, device=query.device)
                self.sinks32.copy_(self.sinks.detach())
                self.inner.sinks = self.sinks32  # an attribute, no allocation
            scales = None
            if self.cache_dtype is not None:  # fp8: vLLM's uint8 cache seen as fp8, its layer's descales
                kv_cache, scales = kv_cache.view(self.cache_dtype), _VllmScales(layer)
            cache = attnplug_view(kv_cache, backend, self.num_kv_heads, self.head_size)
            self.inner.forward(scales, query, key, value, cache, attn_metadata, output)
            return output

    return Impl


def _bridged_backend(backend: type, vllm_name: str, impl_cls: type, builder_cls: type) -> type:
    """vLLM's backend class: name, classes, and the declarations vLLM's selection reads."""

    class Backend(V.VllmAttentionBackend):
        supported_dtypes = list(backend.supported_dtypes)
        supported_kv_cache_dtypes = _vllm_kv_dtypes(backend)
        forward_includes_kv_cache_update = True
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

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            sizes = backend.supported_kernel_block_sizes
            return [V.MultipleOf(1)] if sizes is None else list(sizes)

        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return list(backend.supported_head_sizes or [])

        @classmethod
        def supports_sliding_window(cls) -> bool:
            return backend.supports_sliding_window()

        @classmethod
        def supports_sink(cls) -> bool:
            return backend.supports_sink()

        @classmethod
        def supports_attn_type(cls, attn_type: str) -> bool:
            return attn_type == V.VllmAttentionType.DECODER

        @classmethod
        def supported_kv_cache_layouts(cls):
            return (V.KVCacheLayout.LBHNC, V.KVCacheLayout.LBNHC)

    return Backend

