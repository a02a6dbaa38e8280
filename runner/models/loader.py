"""``build_model`` (config -> model with per-layer backends) and strict HF weight loading."""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from attnplug.core.contracts import AttentionLayerConfig
from attnplug.core.errors import AttnplugError, BackendUnsupportedError
from attnplug.core.mamba import MambaLayerConfig
from attnplug.runner.models.bamba import BambaModel, bamba_layer_configs
from attnplug.runner.models.bamba_config import BambaModelConfig
from attnplug.runner.models.config import DecoderModelConfig
from attnplug.runner.models.gemma3 import Gemma3Model, gemma3_layer_configs
from attnplug.runner.models.gemma3_config import Gemma3ModelConfig
from attnplug.runner.models.hybrid import HybridModel, HybridModelConfig, hybrid_layer_configs
from attnplug.runner.models.llama import BackendForLayer, DecoderModel, layer_configs
from attnplug.runner.models.registry import resolve_model_config


class WeightLoadError(AttnplugError, ValueError):
    """A state dict does not match the model: missing, unexpected or misshapen tensors.

    Attributes:
        missing: parameter names the model needs that the state dict lacks.
        unexpected: state-dict keys the model has no parameter for.
        mismatched: ``(name, expected_shape, given_shape)`` triples.
    """

    def __init__(self, missing: list[str], unexpected: list[str], mismatched: list[tuple[str, tuple, tuple]]):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched

        def listing(items, limit=8):
            shown = ", ".join(map(str, items[:limit]))
            return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")

        parts = []
        if missing:
            parts.append(f"missing {len(missing)} keys: {listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} keys: {listing(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatches: "
                         + listing([f"{n} expects {list(e)} got {list(g)}" for n, e, g in mismatched]))
        super().__init__("state dict does not match the model: " + "; ".join(parts)
                         + ". The weights must come from an HF model of the same config "
                           "(same architecture, sizes and tie_word_embeddings). Nothing was loaded.")


WeightLoadError.__module__ = "attnplug"

IGNORED_HF_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Keys some HF checkpoints carry that are recomputed here (RoPE inverse frequencies)."""


def _default_backend(layer_name: str, layer_cfg: AttentionLayerConfig | MambaLayerConfig):
    from attnplug.plugins.discovery import get_backend
    return get_backend("mamba2_torch" if isinstance(layer_cfg, MambaLayerConfig) else "torch_native")


def model_layer_configs(cfg: DecoderModelConfig | BambaModelConfig | Gemma3ModelConfig, dtype: torch.dtype,
                        device: torch.device | str, block_size: int
                        ) -> dict[str, AttentionLayerConfig | MambaLayerConfig]:
    """``{layer_name: layer config}`` in model order for any supported family (a Mamba2
    layer gets a :class:`~attnplug.core.mamba.MambaLayerConfig`)."""
    if isinstance(cfg, HybridModelConfig):
        return hybrid_layer_configs(cfg, dtype, device, block_size)
    if isinstance(cfg, BambaModelConfig):
        return bamba_layer_configs(cfg, dtype, device, block_size)
    if isinstance(cfg, Gemma3ModelConfig):
        return gemma3_layer_configs(cfg, dtype, device, block_size)
    return layer_configs(cfg, dtype, device, block_size)


def build_model(config: Any, *, backend_for_layer: BackendForLayer | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                block_size: int = 16, seed: int | None = 0) -> DecoderModel | BambaModel | Gemma3Model:
    """Build a Llama / Qwen2 / Mistral / Bamba / Gemma3 model whose layers use chosen backends.

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

    Returns:
        The :class:`DecoderModel` (or :class:`BambaModel`, :class:`Gemma3Model`) in eval mode.

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
    choose = backend_for_layer or _default_backend
    backends = []
    for name, layer_cfg in model_layer_configs(cfg, dtype, device, block_size).items():
        backend = choose(name, layer_cfg)
        reasons = backend.validate_configuration(layer_cfg)
        if reasons:
            raise BackendUnsupportedError(backend.get_name(), reasons, context=f"layer {name}")
        backends.append(backend)
    if isinstance(cfg, HybridModelConfig):
        model = HybridModel(cfg, backends, dtype=dtype, device=device, block_size=block_size)
    elif isinstance(cfg, BambaModelConfig):
        model = BambaModel(cfg, backends, dtype=dtype, device=device, block_size=block_size)
    elif isinstance(cfg, Gemma3ModelConfig):
        model = Gemma3Model(cfg, backends, dtype=dtype, device=device)
    else:
        model = DecoderModel(cfg, backends, dtype=dtype, device=device)
    model.init_weights(seed)
    return model.eval()


def load_hf_state_dict(model: DecoderModel | BambaModel | Gemma3Model, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy HF weights into ``model``, strictly: validate everything first, then copy.

    Args:
        model: the target.
        state_dict: HF ``*ForCausalLM.state_dict()`` (or a checkpoint's tensors), same
            parameter names. With tied embeddings ``lm_head.weight`` may be absent (it is
            ``model.embed_tokens.weight``) or present (then ignored). Keys matching
            :data:`IGNORED_HF_KEYS` are ignored. Tensors are cast to the model's dtype and
            device.

    Raises:
        WeightLoadError: missing, unexpected, or wrongly shaped tensors (all listed); the
            model is unchanged.
    """
    params = dict(model.named_parameters())  # tied lm_head.weight appears once, as embed_tokens
    tied = model.config.tie_word_embeddings
    given = {k: v for k, v in state_dict.items()
             if not IGNORED_HF_KEYS.search(k) and not (tied and k == "lm_head.weight")}
    missing = sorted(set(params) - set(given))
    unexpected = sorted(set(given) - set(params))
    mismatched = [(k, tuple(params[k].shape), tuple(given[k].shape)) for k in sorted(set(params) & set(given))
                  if tuple(params[k].shape) != tuple(given[k].shape)]
    if missing or unexpected or mismatched:
        raise WeightLoadError(missing, unexpected, mismatched)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(given[name].to(device=p.device, dtype=p.dtype))
