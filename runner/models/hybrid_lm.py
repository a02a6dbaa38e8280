"""``HybridCausalLM``: the causal-LM wrapper shared by the attention + state-layer hybrids.

Bamba (Mamba2 + attention, ``bamba.py``) and Qwen3-Next / Qwen3.5 (Gated DeltaNet +
gated attention, ``qwen3_next.py``) wrap their body the same way: HF's module tree
``model.{embed_tokens, layers.N, <final norm>}`` plus ``lm_head`` (tied to the embeddings
when ``tie_word_embeddings``), one decoder block per layer whose mixer is either attention
(``self_attn``) or a state layer (``mamba`` / ``linear_attn``), full-attention layers in a
:class:`FullAttentionSpec` group and state layers in a group of one state slot per request.
This class holds that wrapper once; a family supplies its body, its layer-config function,
the attribute names that differ, and its state layer's cache spec.

A subclass sets:
    body_class: built as ``body_class(cfg, layer_cfgs, backends, dtype, device)``
        (``layer_cfgs`` a list, one per decoder block, in model order); exposes
        ``embed_tokens``, ``layers`` (blocks with ``layer_name`` and ``self_attn`` or the
        state mixer) and the final norm.
    build_layer_configs: ``staticmethod(fn(cfg, dtype, device, block_size) -> {layer_name:
        AttentionLayerConfig | StateLayerConfig})`` in model order.
    state_attr: the block attribute of the state mixer (``"mamba"``, ``"linear_attn"``).
    final_norm_attr: the body attribute of the final norm (``"final_layernorm"``, ``"norm"``).
and implements :meth:`state_spec`, plus ``init_weights`` (family-specific defaults).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import nn

from attnplug.cache_groups.specs import FullAttentionSpec, KVCacheSpec
from attnplug.core.contracts import AttentionBackend, AttentionLayerConfig, AttentionType
from attnplug.core.devices import resolve_device
from attnplug.runner.models.cpu_linear import Linear
from attnplug.runner.models.layers import Attention, lookup_layer, lookup_metadata
from attnplug.runner.models.llama import attention_layer_name
from attnplug.runner.models.weights import load_hf_state_dict


def hybrid_layer_configs(cfg: Any, dtype: torch.dtype, device: torch.device | str, block_size: int,
                         state_layer_name: Callable[[int], str],
                         state_layer_config: Callable[[Any, torch.dtype, str, int], Any]) -> dict[str, Any]:
    """``{layer_name: AttentionLayerConfig | state layer config}`` in model order.

    Layer ``i`` is full attention (``attention_layer_name(i)``: ``num_attention_heads``,
    ``num_key_value_heads``, ``head_size`` of ``cfg``, decoder attention) when
    ``cfg.layer_types[i] == "full_attention"``, else a state layer named
    ``state_layer_name(i)`` configured by ``state_layer_config(cfg, dtype, device_type,
    block_size)``.
    """
    dev = torch.device(device).type
    out: dict[str, Any] = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            out[attention_layer_name(i)] = AttentionLayerConfig(
                num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_size,
                dtype=dtype, block_size=block_size, attn_type=AttentionType.DECODER, device=dev)
        else:
            out[state_layer_name(i)] = state_layer_config(cfg, dtype, dev, block_size)
    return out


class HybridDecoderLayer(nn.Module):
    """``h += mixer(input_layernorm(h)); h += mlp(mlp_norm(h))``, the mixer attention
    (``self_attn(h, positions, cache, metadata)``) or a state layer
    (``<state_attr>(h, cache, metadata)``).

    A subclass builds ``input_layernorm``, the mixer, the MLP norm and the MLP in HF's
    names and sets ``layer_name``; it names them with the class attributes ``state_attr``,
    ``mlp_norm_attr`` and ``mlp_attr``.
    """

    state_attr: ClassVar[str]
    mlp_norm_attr: ClassVar[str]
    mlp_attr: ClassVar[str]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cache, attn_metadata) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> same shape and dtype."""
        h = self.input_layernorm(hidden)
        if hasattr(self, self.state_attr):
            h = getattr(self, self.state_attr)(h, cache, attn_metadata)
        else:
            h = self.self_attn(h, positions, cache, attn_metadata)
        hidden = hidden + h
        return hidden + getattr(self, self.mlp_attr)(getattr(self, self.mlp_norm_attr)(hidden))


class HybridCausalLM(nn.Module):
    """A hybrid (attention + state layers) causal LM whose layers run through pluggable
    backends. Same step interface as :class:`~attnplug.runner.models.llama.DecoderModel`.

    Args:
        cfg: the family's normalized config (``hidden_size``, ``vocab_size``,
            ``num_key_value_heads``, ``head_size``, ``tie_word_embeddings`` are read here).
        backends: per decoder block, the backend of its mixer (an attention backend for
            attention layers, a state backend, e.g. :class:`~attnplug.core.mamba.MambaBackend`
            or :class:`~attnplug.core.gdn.GDNBackend`, for state layers).
        dtype, device: of parameters and activations.
        block_size: recorded in the layer configs.

    Attributes:
        layer_names: every layer name (attention and state) in model order.
    """

    body_class: ClassVar[type[nn.Module]]
    build_layer_configs: ClassVar[Callable[..., dict[str, Any]]]
    state_attr: ClassVar[str]
    final_norm_attr: ClassVar[str]

    def __init__(self, cfg: Any, backends: list[type[AttentionBackend]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", block_size: int = 16):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.device = resolve_device(device)
        layer_cfgs = list(type(self).build_layer_configs(cfg, dtype, device, block_size).values())
        self.model = self.body_class(cfg, layer_cfgs, backends, dtype, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.layer_names: list[str] = [layer.layer_name for layer in self.model.layers]

    @property
    def attention_layers(self) -> dict[str, Attention]:
        """``{layer_name: Attention}`` of the attention layers, in model order."""
        return {l.layer_name: l.self_attn for l in self.model.layers if hasattr(l, "self_attn")}

    @property
    def mamba_layers(self) -> dict[str, nn.Module]:
        """``{layer_name: state mixer}`` of the state layers (the blocks' ``state_attr``), in
        model order."""
        attr = self.state_attr
        return {l.layer_name: getattr(l, attr) for l in self.model.layers if hasattr(l, attr)}

    def layer_configs(self, block_size: int) -> dict[str, Any]:
        """What each layer needs of a backend (the family's ``build_layer_configs``)."""
        return type(self).build_layer_configs(self.config, self.dtype, self.device, block_size)

    def state_spec(self, layer_cfg: Any, block_size: int) -> KVCacheSpec:
        """The cache spec of one state layer (given its layer config)."""
        raise NotImplementedError(f"{type(self).__name__} must implement state_spec")

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """``{layer_name: FullAttentionSpec | <state spec>}`` in model order: attention layers
        keep paged K/V of ``num_key_value_heads x head_size`` in the model dtype; state layers
        get :meth:`state_spec`."""
        cfg = self.config
        specs: dict[str, KVCacheSpec] = {}
        for name, lc in self.layer_configs(block_size).items():
            if isinstance(lc, AttentionLayerConfig):
                specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=cfg.num_key_value_heads,
                                                head_size=cfg.head_size, dtype=self.dtype)
            else:
                specs[name] = self.state_spec(lc, block_size)
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Mapping[str, object],
                kv_caches: Mapping[str, object]) -> torch.Tensor:
        """Run one step over a flat token stream (see ``DecoderModel.forward``).

        ``kv_caches[name]`` is a paged KV tensor for attention layers and the state cache
        (e.g. :class:`~attnplug.core.mamba.MambaStateCache`) for state layers;
        ``attn_metadata[name]`` is the layer's group metadata. Returns the final-normed
        hidden states ``[num_tokens, hidden_size]``.

        Raises:
            MetadataError: a layer missing from ``attn_metadata`` or ``kv_caches``.
        """
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            name = layer.layer_name
            hidden = layer(hidden, positions, lookup_layer(kv_caches, name, "kv_caches"),
                           lookup_metadata(attn_metadata, name))
        return getattr(self.model, self.final_norm_attr)(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits (LM head)."""
        return self.lm_head(hidden_states).float()

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy the family's HF ``*ForCausalLM`` state dict into this model (strict; see
        :func:`attnplug.runner.models.weights.load_hf_state_dict`)."""
        load_hf_state_dict(self, state_dict)


__all__ = ["HybridCausalLM", "HybridDecoderLayer", "hybrid_layer_configs"]
