"""A vLLM attention backend as an attnplug backend: ``attnplug check vllm:NAME``.

``vllm_backend("FLEX_ATTENTION")`` is an attnplug ``AttentionBackend`` whose impl runs vLLM's
``AttentionBackendEnum.FLEX_ATTENTION`` class, built as vLLM builds it: a real ``VllmConfig``
(its ``ModelConfig`` read from a ``config.json`` written for the layer's sizes) and a real
vLLM ``Attention`` layer made under it (so it registers in the config's forward context and
carries its KV scales), whose impl is the backend's. The builder is vLLM's, made on the first
``build`` (after the impl: vLLM's CPU builder finds its layers in the config) with the
layer's own ``get_kv_cache_spec`` at the step's kernel block size.

Declarations come from vLLM's: dtypes, head sizes, kernel block sizes (``MultipleOf(n)``
-> ``(n,)``: every multiple of n is then split into n-token kernel blocks), sliding
window, decoder only, and the KV packing: the backend's ``supported_kv_cache_layouts()``
read as attnplug's ``KVCacheLayout`` (``reverse_layout.py``), so the conformance suite
allocates, poisons and reads the cache in the order vLLM's kernels read it, and the impl
hands vLLM its logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view of
the same storage. CPU_ATTN is the exception (:data:`KV_SPLITS`): its kernels pack K
transposed, which its declaration (``LBHNC``) does not say.

The K/V write is vLLM's own (``do_kv_cache_update``) where it runs; where its compiled
cache op is not loaded (vLLM 0.33's CUDA wheel on a CPU) the impl writes by the same
layout (``reverse_layout.write_kv``, ``reshape_and_cache_flash``'s contract) and the
backend's ``kv_writer`` says ``"attnplug"``: the suite's KV check then judges that write,
and its output checks judge that vLLM's attention reads the packing the layout names.

Refused (``ValueError``): an unknown name, a backend class that does not import here, and
the other cache kinds (vLLM's MLA, sparse and state backends: ``is_mla`` / ``is_sparse`` /
``is_ssm``), which attnplug's paged-attention suite does not drive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import tempfile
from typing import Any

import torch

from attnplug.core.contracts import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from attnplug.core.errors import BackendUnsupportedError
from attnplug.plugins.vllm import _vllm as V
from attnplug.plugins.vllm.reverse_layout import (
    PACKING_OVERRIDES,
    declared_layout,
    missing_compiled_op,
    vllm_view,
    write_kv,
)

KV_SPLITS: dict[str, tuple[str, ...]] = {"CPU_ATTN": ("vec", "vec16")}
"""The backends of ``reverse_layout.PACKING_OVERRIDES`` and the kernel ISAs whose packing
the bridge knows. vLLM 0.32's CPU_ATTN writes each (block, KV head) slice of ``[block_size, 2 *
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


def _static_shapes() -> contextlib.AbstractContextManager:
    """vLLM's ``torch.compile``-d calls (FLEX_ATTENTION's ``flex_attention`` and
    ``create_block_mask``) compiled for static shapes, one graph per case shape: with
    dynamo's automatic dynamic shapes, torch 2.13's inductor fails to compile the CPU flex
    template once a second shape arrives (``CppCompileError``: ``'cur_kvSplitSize4' was not
    declared`` in its generated C++). Running them eagerly is no way out: eager
    ``flex_attention`` multiplies every cached block (masked ones by zero), so the suite's
    NaN-poisoned blocks reach every output. The suite's shapes outnumber vLLM's
    ``recompile_limit`` (16), so the limit is raised for the call. Off the CPU: unchanged."""
    if not V.current_platform.is_cpu():
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=4096,
                                      accumulated_recompile_limit=1 << 16)


class _Metadata:
    """One step: vLLM's ``CommonAttentionMetadata``, the slot mapping of its real tokens, and
    vLLM's backend metadata, built by vLLM's builder on the first forward (:meth:`vllm_for`):
    some builders (FLEX_ATTENTION's) read the cache's size, ``cache_config.num_gpu_blocks``,
    which vLLM's engine sets after planning and attnplug's builder contract does not carry."""

    def __init__(self, builder: Any, common: Any, slot_mapping: torch.Tensor, num_actual_tokens: int):
        self.builder, self.common, self._vllm = builder, common, None
        self.slot_mapping, self.num_actual_tokens = slot_mapping, num_actual_tokens

    def vllm_for(self, num_blocks: int) -> Any:
        """vLLM's metadata for a cache of ``num_blocks`` kernel blocks (built once)."""
        if self._vllm is None:
            config = self.builder.owner.config
            config.cache_config.num_gpu_blocks = num_blocks
            with V.set_current_vllm_config(config), _static_shapes():
                self._vllm = self.builder.inner.build(0, self.common)
        return self._vllm


def _readable_dtypes(name: str, vcls: Any, sizes: list) -> tuple[torch.dtype, ...]:
    """vLLM's dtypes for ``name`` (a :data:`KV_SPLITS` backend) less those whose kernel ISA
    on this machine packs K/V in a way the bridge cannot read: on an AMX CPU, CPU_ATTN runs
    bf16 with its ``amx`` kernel at every multiple-of-32 block size (head sizes that are
    multiples of 32), so bf16 is not declared there and the suite skips those cases with
    that declaration instead of failing in ``split_kv_cache``."""
    block = min((getattr(s, "base", s) for s in sizes), default=32)
    return tuple(d for d in vcls.supported_dtypes if V.cpu_attn_isa(d, block, 64) in KV_SPLITS[name])


def vllm_backend(name: str) -> type[AttentionBackend]:
    """The attnplug backend running vLLM's ``AttentionBackendEnum[name]``.

    Raises:
        ValueError: ``name`` is not an ``AttentionBackendEnum`` member, its class does not
            import here, or it is not a paged-attention backend (MLA, sparse, state).
    """
    if name not in V.AttentionBackendEnum.__members__:
        raise ValueError(f"vllm:{name}: not a vLLM AttentionBackendEnum member (known: "
                         f"{', '.join(V.AttentionBackendEnum.__members__)})")
    try:
        vcls = V.AttentionBackendEnum[name].get_class()
    except Exception as exc:  # noqa: BLE001 - vLLM's backend modules fail in many ways without their kernels
        raise ValueError(f"vllm:{name}: its class does not import here ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    for kind, what in (("is_mla", "an MLA backend"), ("is_sparse", "a sparse-attention backend"),
                       ("is_ssm", "a state (SSM) backend")):
        if getattr(vcls, kind, lambda: False)():
            raise ValueError(f"vllm:{name}: {what} ({kind}() is True); the reverse bridge drives paged-attention "
                             "backends only (docs/vllm.md)")
    if name not in PACKING_OVERRIDES:
        declared_layout(vcls)  # a layout it cannot read fails here, naming it
    return _reverse(name)


@dataclasses.dataclass(frozen=True, eq=False)
class _Target:
    """What the three classes of one reversed vLLM backend share (data only)."""

    name: str
    """The ``AttentionBackendEnum`` member's name (``"FLEX_ATTENTION"``)."""
    vcls: Any
    """vLLM's backend class."""
    packed: bool
    """The cache is vLLM's logical 4-D tensor, packed by the kernel's own rule
    (``reverse_layout.PACKING_OVERRIDES``: CPU_ATTN)."""
    layout: Any
    """attnplug's ``KVCacheLayout`` of the declared packing; ``None`` when ``packed``."""
    vllm_layout: str
    """The vLLM ``KVCacheLayout`` name the cache follows."""
    impls: dict = dataclasses.field(default_factory=dict)
    """``(num_kv_heads, head_size)`` -> the last impl made, whose vLLM layer the builder uses."""


@functools.cache
def _reverse(name: str) -> type[AttentionBackend]:
    vcls = V.AttentionBackendEnum[name].get_class()
    packed = name in PACKING_OVERRIDES
    layout, vllm_layout = (None, "LBHNC") if packed else declared_layout(vcls)
    target = _Target(name, vcls, packed, layout, vllm_layout)
    impl, builder = _impl_class(target), _builder_class(target)
    backend = _backend_class(target, builder, impl)
    impl.backend = backend
    for cls, role in ((builder, "Builder"), (impl, "Impl"), (backend, "Backend")):
        cls.__name__ = cls.__qualname__ = f"Vllm_{name}_{role}"
    return backend


def _impl_class(t: _Target) -> type[AttentionImpl]:
    """The impl: a real vLLM ``Attention`` layer per impl, whose impl runs the forward."""

    class Impl(AttentionImpl):
        backend: type[AttentionBackend]
        """The reversed backend (its ``kv_writer``); set by :func:`_reverse`."""

        def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window=None, logits_soft_cap=None,
                     attn_type="decoder", kv_cache_dtype=None):
            reasons = self.decoder_argument_problems(num_heads, num_kv_heads, sliding_window, logits_soft_cap,
                                                     attn_type)
            if reasons:
                raise BackendUnsupportedError(f"vllm:{t.name}", reasons)
            super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap,
                             attn_type, kv_cache_dtype)
            self.config = _vllm_config(num_heads, num_kv_heads, head_size, torch.get_default_dtype())
            self.layer_name = f"attnplug_check.{t.name}.{len(self.config.compilation_config.static_forward_context)}"
            with V.set_current_vllm_config(self.config):
                self.layer = V.Attention(num_heads, head_size, scale, num_kv_heads=num_kv_heads,
                                         logits_soft_cap=logits_soft_cap, per_layer_sliding_window=sliding_window,
                                         prefix=self.layer_name, attn_backend=t.vcls)
            t.impls[(num_kv_heads, head_size)] = self

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
            n = attn_metadata.num_actual_tokens
            impl = self.layer.impl
            view = kv_cache if t.packed else vllm_view(kv_cache, t.layout)
            with V.set_current_vllm_config(self.config), _static_shapes():
                if not t.vcls.forward_includes_kv_cache_update:
                    self._write(key[:n], value[:n], kv_cache, view, attn_metadata.slot_mapping[:n])
                impl.forward(self.layer, query, key, value, view, attn_metadata.vllm_for(view.shape[0]), output)
            return output

        def _write(self, key, value, kv_cache, view, slot_mapping):
            """vLLM's ``do_kv_cache_update``; the layout's write where its compiled op is not loaded."""
            if self.backend.kv_writer == "vllm":
                try:
                    return self.layer.impl.do_kv_cache_update(self.layer, key, value, view, slot_mapping)
                except AttributeError as exc:
                    if t.packed or not missing_compiled_op(exc):
                        raise
                    self.backend.kv_writer = "attnplug"
            write_kv(t.layout, kv_cache, key, value, slot_mapping)

    return Impl


def _builder_class(t: _Target) -> type[AttentionMetadataBuilder]:
    """The builder: vLLM's ``CommonAttentionMetadata`` per step, vLLM's own builder made on
    the first build (after the impl, whose layer it reads)."""

    class Builder(AttentionMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            m = common_attn_metadata
            if not hasattr(self, "inner"):
                spec = self.kv_cache_spec
                owner = t.impls[(spec.num_kv_heads, spec.head_size)]
                vspec = owner.layer.get_kv_cache_spec(owner.config)
                vspec = dataclasses.replace(vspec, block_size=spec.block_size)
                with V.set_current_vllm_config(owner.config):
                    self.inner = t.vcls.get_builder_cls()(vspec, [owner.layer_name], owner.config, self.device)
                self.owner = owner
            vm = V.VllmCommonAttentionMetadata(
                query_start_loc=m.query_start_loc, query_start_loc_cpu=m.query_start_loc_cpu, seq_lens=m.seq_lens,
                num_reqs=m.num_reqs, num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                max_seq_len=m.max_seq_len, block_table_tensor=m.block_table_tensor, slot_mapping=m.slot_mapping,
                causal=m.causal, positions=m.positions, is_prefilling=m.is_prefilling)
            return _Metadata(self, vm, m.slot_mapping, m.num_actual_tokens)

    return Builder


def _backend_class(t: _Target, builder: type[AttentionMetadataBuilder],
                   impl: type[AttentionImpl]) -> type[AttentionBackend]:
    """The backend: vLLM's declarations, and the cache in the packing vLLM's kernels read."""
    sizes = t.vcls.get_supported_kernel_block_sizes()
    name, vcls, packed, layout = t.name, t.vcls, t.packed, t.layout

    class Backend(AttentionBackend):
        supported_dtypes = _readable_dtypes(name, vcls, sizes) if packed else tuple(vcls.supported_dtypes)
        supported_head_sizes = tuple(vcls.get_supported_head_sizes()) or None
        supported_kernel_block_sizes = tuple(getattr(s, "base", s) for s in sizes) or None
        supported_devices = ("cpu",) if V.current_platform.is_cpu() else ("cuda",)
        kv_cache_layout = None if packed else layout
        """The packing as attnplug's descriptor; ``None`` for a packed cache (CPU_ATTN's transposed
        K, which no ``KVCacheLayout`` says: ``split_kv_cache`` alone reads it)."""
        vllm_kv_cache_layout = t.vllm_layout
        """The vLLM ``KVCacheLayout`` name the cache follows (the backend's first declared)."""
        kv_writer = "vllm"
        """Who writes K/V: ``"vllm"`` (its ``do_kv_cache_update``) or ``"attnplug"`` (after
        that raised for a compiled op that is not loaded: ``reverse_layout.write_kv``)."""

        @classmethod
        def get_name(cls):
            return f"vllm:{name}"

        @classmethod
        def get_builder_cls(cls):
            return builder

        @classmethod
        def get_impl_cls(cls):
            return impl

        @classmethod
        def supports_sliding_window(cls):
            return vcls.supports_sliding_window()

        @classmethod
        def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size):
            if not packed:
                return layout.shape(num_blocks, block_size, num_kv_heads, head_size)
            return (num_blocks, num_kv_heads, block_size, 2 * head_size)

        @classmethod
        def split_kv_cache(cls, kv_cache):
            if not packed:
                return layout.split(kv_cache)
            _, _, bs, two_hs = kv_cache.shape
            isa = V.cpu_attn_isa(kv_cache.dtype, bs, two_hs // 2)
            if isa not in KV_SPLITS[name]:
                raise BackendUnsupportedError(f"vllm:{name}", [
                    f"its {isa!r} kernel packs K/V in a way the bridge cannot read (known: "
                    f"{', '.join(KV_SPLITS[name])})"], context="split_kv_cache")
            return _split_transposed_k(kv_cache)

    return Backend
