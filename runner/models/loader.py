"""``build_model``: a config -> a model whose layers use chosen backends.

Each supported config class maps to its family in :data:`MODEL_FAMILIES` (the model class
and the function giving its per-layer configs). This module imports the families; no
family imports it. HF weight loading lives in :mod:`attnplug.runner.models.weights`
(:func:`load_hf_state_dict`, :class:`WeightLoadError` and :data:`IGNORED_HF_KEYS` are
imported here too, for callers that import them from this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from attnplug.core.contracts import AttentionLayerConfig
from attnplug.core.errors import BackendUnsupportedError
from attnplug.core.mamba import MambaLayerConfig
from attnplug.core.state import StateLayerConfig
from attnplug.core.mla import MLALayerConfig
from attnplug.runner.models.bamba import BambaModel, bamba_layer_configs
from attnplug.runner.models.bamba_config import BambaModelConfig
from attnplug.runner.models.config import DecoderModelConfig
from attnplug.runner.models.deepseek import DeepseekModel, deepseek_layer_configs
from attnplug.runner.models.deepseek_config import DeepseekModelConfig
from attnplug.runner.models.deepseek_v32 import DeepseekV32Model, deepseek_v32_layer_configs
from attnplug.runner.models.deepseek_v32_config import DeepseekV32ModelConfig
from attnplug.runner.models.gemma3 import Gemma3Model, gemma3_layer_configs
from attnplug.runner.models.gemma3_config import Gemma3ModelConfig
from attnplug.runner.models.gpt_oss import GptOssModel, gpt_oss_layer_configs
from attnplug.runner.models.gpt_oss_config import GptOssModelConfig
from attnplug.runner.models.hybrid import HybridModel, HybridModelConfig, hybrid_layer_configs
from attnplug.runner.models.llama import BackendForLayer, DecoderModel, layer_configs
from attnplug.runner.models.qwen2_vl import Qwen2VLModel
from attnplug.runner.models.qwen2_vl_config import Qwen2VLModelConfig
from attnplug.runner.models.qwen3 import Qwen3Model
from attnplug.runner.models.qwen3_config import Qwen3ModelConfig
from attnplug.runner.models.qwen3_next import Qwen3NextModel, qwen3_next_layer_configs
from attnplug.runner.models.qwen3_next_config import Qwen3NextModelConfig
from attnplug.runner.models.registry import resolve_model_config
from attnplug.runner.models.weights import IGNORED_HF_KEYS, WeightLoadError, load_hf_state_dict

LayerConfigs = Callable[[Any, torch.dtype, torch.device | str, int],
                        dict[str, AttentionLayerConfig | MambaLayerConfig]]
"""``(cfg, dtype, device, block_size) -> {layer_name: layer config}`` in model order."""


@dataclass(frozen=True)
class ModelFamily:
    """How :func:`build_model` builds one config class's model.

    Attributes:
        model_cls: the model class, called as ``model_cls(cfg, backends, dtype=, device=)``.
        layer_configs: the family's per-layer configs (:data:`LayerConfigs`).
        takes_block_size: ``model_cls`` also takes ``block_size=`` (the Mamba2 families).
    """

    model_cls: type[nn.Module]
    layer_configs: LayerConfigs
    takes_block_size: bool = False


MODEL_FAMILIES: dict[type, ModelFamily] = {
    DecoderModelConfig: ModelFamily(DecoderModel, layer_configs),
    Qwen3ModelConfig: ModelFamily(Qwen3Model, layer_configs),
    Qwen2VLModelConfig: ModelFamily(Qwen2VLModel, layer_configs),
    DeepseekModelConfig: ModelFamily(DeepseekModel, deepseek_layer_configs),
    DeepseekV32ModelConfig: ModelFamily(DeepseekV32Model, deepseek_v32_layer_configs),
    BambaModelConfig: ModelFamily(BambaModel, bamba_layer_configs, takes_block_size=True),
    HybridModelConfig: ModelFamily(HybridModel, hybrid_layer_configs, takes_block_size=True),
    Gemma3ModelConfig: ModelFamily(Gemma3Model, gemma3_layer_configs),
    GptOssModelConfig: ModelFamily(GptOssModel, gpt_oss_layer_configs),
    Qwen3NextModelConfig: ModelFamily(Qwen3NextModel, qwen3_next_layer_configs, takes_block_size=True),
}
"""Config class -> its :class:`ModelFamily`. A config's family is that of the nearest
class in its MRO (``HybridModelConfig`` subclasses ``BambaModelConfig``); a config of no
listed class is treated as a :class:`DecoderModelConfig` (``Qwen3ModelConfig`` subclasses it
and is listed before it in every MRO)."""


def model_family(cfg: Any) -> ModelFamily:
    """The :class:`ModelFamily` of ``cfg`` (see :data:`MODEL_FAMILIES`)."""
    for klass in type(cfg).__mro__:
        family = MODEL_FAMILIES.get(klass)
        if family is not None:
            return family
    return MODEL_FAMILIES[DecoderModelConfig]


DEFAULT_STATE_BACKENDS: dict[str, str] = {"mamba2": "mamba2_torch", "gdn": "gdn_torch"}
"""``state_kind`` -> the built-in backend a state layer gets when none is chosen."""


def _default_backend(layer_name: str, layer_cfg: AttentionLayerConfig | MambaLayerConfig):
    from attnplug.plugins.discovery import get_backend
    if isinstance(layer_cfg, MLALayerConfig):
        return get_backend("torch_native_sparse_mla" if getattr(layer_cfg, "index_topk", None) else "torch_native_mla")
    if hasattr(layer_cfg, "index_head_dim"):
        return get_backend("torch_native_indexer")
    if isinstance(layer_cfg, StateLayerConfig):
        return get_backend(DEFAULT_STATE_BACKENDS[layer_cfg.state_kind])
    return get_backend("torch_native")


def model_layer_configs(cfg: DecoderModelConfig | BambaModelConfig | Gemma3ModelConfig, dtype: torch.dtype,
                        device: torch.device | str, block_size: int
                        ) -> dict[str, AttentionLayerConfig | MambaLayerConfig]:
    """``{layer_name: layer config}`` in model order for any supported family (a Mamba2
    layer gets a :class:`~attnplug.core.mamba.MambaLayerConfig`)."""
    return model_family(cfg).layer_configs(cfg, dtype, device, block_size)


def build_model(config: Any, *, backend_for_layer: BackendForLayer | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                block_size: int = 16, seed: int | None = 0,
                init: bool = True) -> DecoderModel | BambaModel | Gemma3Model:
    """Build a Llama / Qwen2 / Mistral / Qwen3 / Qwen3-MoE / Bamba / Gemma3 model over chosen backends.

    Args:
        config: a ``transformers.PretrainedConfig``, a dict, or a ``config.json`` path (or
            its directory) of a supported architecture.
        backend_for_layer: ``(layer_name, layer_cfg) -> AttentionBackend`` subclass, called
            once per attention or Mamba2 layer (``layer_cfg`` is then a
            :class:`~attnplug.core.mamba.MambaLayerConfig`); ``None`` uses ``torch_native``
            for attention and ``mamba2_torch`` for Mamba2. Each layer's impl is
            ``backend.get_impl_cls()(...)``.
        dtype: parameter / activation / KV-cache dtype (float32, float16, bfloat16).
        device: where parameters live.
        block_size: the KV block size put into the ``layer_cfg`` given to
            ``backend_for_layer`` and checked by ``validate_configuration``.
        seed: random init seed (HF-style init; overwritten by :meth:`load_hf_state_dict`);
            ``None`` uses the global RNG.
        init: ``False`` skips the random init (the weights are loaded next: real weights).

    Returns:
        The :class:`DecoderModel` (its subclass ``Qwen3Model`` for Qwen3 / Qwen3-MoE; or
        :class:`BambaModel`, :class:`Gemma3Model`) in eval mode.

    Raises:
        UnsupportedModelError: not a supported architecture (lists the supported ones).
        ModelConfigError: an invalid config.
        BackendUnsupportedError: a chosen backend rejects its layer (every reason listed).

    Examples:
        >>> cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        ...        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
        >>> model = build_model(cfg)
        >>> model.layer_names
        ['model.layers.0.self_attn.attn', 'model.layers.1.self_attn.attn']
    """
    cfg = resolve_model_config(config)
    model = construct_model(cfg, dtype, device, block_size, backend_for_layer)
    if init:
        model.init_weights(seed)
    return model.eval()


def construct_model(cfg, dtype: torch.dtype, device: torch.device | str, block_size: int,
                    backend_for_layer: Callable | None = None):
    """The family's model for a resolved ``cfg``, weights not initialised: each layer's backend
    is ``backend_for_layer(name, layer_cfg)`` (``None`` from it, or no callable: torch_native,
    or mamba2_torch for Mamba layers), validated against its layer config first.

    Raises:
        BackendUnsupportedError: a backend refuses its layer's configuration (names the layer).
        ModelConfigError: no family takes ``cfg``.
    """
    family = model_family(cfg)
    backends = []
    for name, layer_cfg in family.layer_configs(cfg, dtype, device, block_size).items():
        backend = (backend_for_layer(name, layer_cfg) if backend_for_layer else None) \
            or _default_backend(name, layer_cfg)
        reasons = backend.validate_configuration(layer_cfg)
        if reasons:
            raise BackendUnsupportedError(backend.get_name(), reasons, context=f"layer {name}")
        backends.append(backend)
    extra = {"block_size": block_size} if family.takes_block_size else {}
    return family.model_cls(cfg, backends, dtype=dtype, device=device, **extra)


__all__ = ["IGNORED_HF_KEYS", "MODEL_FAMILIES", "ModelFamily", "WeightLoadError", "build_model", "construct_model",
           "load_hf_state_dict", "model_family", "model_layer_configs"]
