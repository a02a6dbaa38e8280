"""A vLLM attention backend as an attnplug backend: ``attnplug check vllm:NAME``.

``vllm_backend("CPU_ATTN")`` is an attnplug ``AttentionBackend`` whose impl runs vLLM's
``AttentionBackendEnum.CPU_ATTN`` class, built as vLLM builds it: a real ``VllmConfig``
(its ``ModelConfig`` read from a ``config.json`` written for the layer's sizes) and a
real vLLM ``Attention`` layer made under it (so it registers in the config's forward
context and carries its KV scales), whose impl is the backend's. The builder is vLLM's,
made on the first ``build`` (after the impl: vLLM's CPU builder finds its layers in the
config) with the layer's own ``get_kv_cache_spec`` at the step's kernel block size.

Declarations come from vLLM's: dtypes, head sizes, kernel block sizes (``MultipleOf(n)``
-> ``(n,)``: every multiple of n is then split into n-token kernel blocks), sliding
window, decoder only. The KV cache is vLLM's per-layer logical ``[num_blocks,
num_kv_heads, block_size, 2 * head_size]`` (layout ``LBHNC``); how K and V share the
last two dims is the backend's own convention (for CPU_ATTN: K transposed per block and
head, see :data:`KV_SPLITS`), read back through ``split_kv_cache`` -- the conformance
suite reads and poisons caches only that way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from typing import Any

import torch

from attnplug.core.contracts import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from attnplug.core.errors import BackendUnsupportedError
from attnplug.plugins.vllm import _vllm as V

KV_SPLITS: dict[str, tuple[str, ...]] = {"CPU_ATTN": ("vec", "vec16")}
"""The vLLM backends the reverse bridge can read, and the kernel ISAs whose packing it
knows. vLLM 0.32's CPU_ATTN writes each (block, KV head) slice of ``[block_size, 2 *
head_size]`` as K *transposed* (``[head_size, block_size]``: dim d of token n at
``d * block_size + n``) followed by V row-major (``[block_size, head_size]``), for its
``vec`` and ``vec16`` kernels (found by writing known K/V through
``do_kv_cache_update``; ``tests/vllm/test_vllm_reverse.py`` keeps it true). The ISA is
vLLM's own choice for (dtype, block size, head size); ``amx`` (bf16 on AMX CPUs) packs
differently and is refused by ``split_kv_cache``."""


def _split_transposed_k(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, heads, bs, two_hs = kv_cache.shape
    hs = two_hs // 2
    flat = kv_cache.view(blocks, heads, 2 * bs * hs)
    k = flat[..., : bs * hs].view(blocks, heads, hs, bs).permute(0, 3, 1, 2)
    v = flat[..., bs * hs:].view(blocks, heads, bs, hs).transpose(1, 2)
    return k, v


@functools.cache
def _vllm_config(num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> Any:
    model_dir = tempfile.mkdtemp(prefix="attnplug-vllm-layer-")
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
          "hidden_size": num_heads * head_size, "head_dim": head_size, "num_attention_heads": num_heads,
          "num_key_value_heads": num_kv_heads, "intermediate_size": 64, "vocab_size": 64,
          "max_position_embeddings": 4096}
    with open(f"{model_dir}/config.json", "w", encoding="utf-8") as f:
        json.dump(hf, f)
    model = V.ModelConfig(model=model_dir, dtype=dtype, skip_tokenizer_init=True, max_model_len=4096)
    return V.VllmConfig(model_config=model)


class _Metadata:
    """vLLM's metadata for one step and the slot mapping of its real tokens."""

    def __init__(self, vllm_metadata: Any, slot_mapping: torch.Tensor, num_actual_tokens: int):
        self.vllm, self.slot_mapping, self.num_actual_tokens = vllm_metadata, slot_mapping, num_actual_tokens


def vllm_backend(name: str) -> type[AttentionBackend]:
    """The attnplug backend running vLLM's ``AttentionBackendEnum[name]``.

    Raises:
        ValueError: ``name`` is not an ``AttentionBackendEnum`` member, or the bridge does
            not know how that backend packs K and V (:data:`KV_SPLITS`).
    """
    if name not in V.AttentionBackendEnum.__members__:
        raise ValueError(f"vllm:{name}: not a vLLM AttentionBackendEnum member (known: "
                         f"{', '.join(V.AttentionBackendEnum.__members__)})")
    if name not in KV_SPLITS:
        raise ValueError(f"vllm:{name}: how it packs K and V in its KV cache is not declared to the bridge "
                         f"(known: {', '.join(KV_SPLITS)}; plugins/vllm/reverse.py KV_SPLITS)")
    return _reverse(name)


@functools.cache
def _reverse(name: str) -> type[AttentionBackend]:
    vcls = V.AttentionBackendEnum[name].get_class()
    impls: dict[tuple, Any] = {}  # (num_kv_heads, head_size, dtype) -> the last impl made, for the builder

    class Impl(AttentionImpl):
        def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window=None, logits_soft_cap=None,
                     attn_type="decoder", kv_cache_dtype=None):
            reasons = self.decoder_argument_problems(num_heads, num_kv_heads, sliding_window, logits_soft_cap,
                                                     attn_type)
            if reasons:
                raise BackendUnsupportedError(f"vllm:{name}", reasons)
            super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap,
                             attn_type, kv_cache_dtype)
            self.config = _vllm_config(num_heads, num_kv_heads, head_size, torch.get_default_dtype())
            self.layer_name = f"attnplug_check.{name}.{len(self.config.compilation_config.static_forward_context)}"
            with V.set_current_vllm_config(self.config):
                self.layer = V.Attention(num_heads, head_size, scale, num_kv_heads=num_kv_heads,
                                         logits_soft_cap=logits_soft_cap, per_layer_sliding_window=sliding_window,
                                         prefix=self.layer_name, attn_backend=vcls)
            impls[(num_kv_heads, head_size)] = self

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
            n = attn_metadata.num_actual_tokens
            impl = self.layer.impl
            with V.set_current_vllm_config(self.config):
                if not vcls.forward_includes_kv_cache_update:
                    impl.do_kv_cache_update(self.layer, key[:n], value[:n], kv_cache, attn_metadata.slot_mapping[:n])
                impl.forward(self.layer, query, key, value, kv_cache, attn_metadata.vllm, output)
            return output

    class Builder(AttentionMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            m = common_attn_metadata
            if not hasattr(self, "inner"):
                spec = self.kv_cache_spec
                owner = impls[(spec.num_kv_heads, spec.head_size)]
                vspec = owner.layer.get_kv_cache_spec(owner.config)
                vspec = dataclasses.replace(vspec, block_size=spec.block_size)
                with V.set_current_vllm_config(owner.config):
                    self.inner = vcls.get_builder_cls()(vspec, [owner.layer_name], owner.config, self.device)
                self.owner = owner
            vm = V.VllmCommonAttentionMetadata(
                query_start_loc=m.query_start_loc, query_start_loc_cpu=m.query_start_loc_cpu, seq_lens=m.seq_lens,
                num_reqs=m.num_reqs, num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                max_seq_len=m.max_seq_len, block_table_tensor=m.block_table_tensor, slot_mapping=m.slot_mapping,
                causal=m.causal, positions=m.positions, is_prefilling=m.is_prefilling)
            with V.set_current_vllm_config(self.owner.config):
                return _Metadata(self.inner.build(0, vm), m.slot_mapping, m.num_actual_tokens)

    sizes = vcls.get_supported_kernel_block_sizes()

    class Backend(AttentionBackend):
        supported_dtypes = tuple(vcls.supported_dtypes)
        supported_head_sizes = tuple(vcls.get_supported_head_sizes()) or None
        supported_kernel_block_sizes = tuple(getattr(s, "base", s) for s in sizes) or None
        supported_devices = ("cpu",) if V.current_platform.is_cpu() else ("cuda",)

        @classmethod
        def get_name(cls):
            return f"vllm:{name}"

        @classmethod
        def get_builder_cls(cls):
            return Builder

        @classmethod
        def get_impl_cls(cls):
            return Impl

        @classmethod
        def supports_sliding_window(cls):
            return vcls.supports_sliding_window()

        @classmethod
        def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size):
            return (num_blocks, num_kv_heads, block_size, 2 * head_size)

        @classmethod
        def split_kv_cache(cls, kv_cache):
            _, _, bs, two_hs = kv_cache.shape
            isa = V.cpu_attn_isa(kv_cache.dtype, bs, two_hs // 2)
            if isa not in KV_SPLITS[name]:
                raise BackendUnsupportedError(f"vllm:{name}", [
                    f"its {isa!r} kernel packs K/V in a way the bridge cannot read (known: "
                    f"{', '.join(KV_SPLITS[name])})"], context="split_kv_cache")
            return _split_transposed_k(kv_cache)

    for cls, role in ((Builder, "Builder"), (Impl, "Impl"), (Backend, "Backend")):
        cls.__name__ = cls.__qualname__ = f"Vllm_{name}_{role}"
    return Backend
