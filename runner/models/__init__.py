"""Llama-family decoder models (Llama, Qwen2, Mistral) over pluggable attention backends.

Build from an HF config with :func:`build_model`, load HF weights with
``model.load_hf_state_dict``, or get a bundled random-weight preset with
:func:`make_preset_model`. ``transformers`` is not needed (only the parity tests use it).
"""

from attnplug.runner.models.config import DecoderModelConfig, ModelConfigError, RopeScaling
from attnplug.runner.models.llama import DecoderModel, attention_layer_name, layer_configs
from attnplug.runner.models.loader import WeightLoadError, build_model, load_hf_state_dict
from attnplug.runner.models.presets import DEFAULT_PRESET, PRESETS, make_preset_model, preset_config
from attnplug.runner.models.registry import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    UnsupportedModelError,
    resolve_model_config,
)

__all__ = [
    "DEFAULT_PRESET", "PRESETS", "SUPPORTED_ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "DecoderModel",
    "DecoderModelConfig", "ModelConfigError", "RopeScaling", "UnsupportedModelError", "WeightLoadError",
    "attention_layer_name", "build_model", "layer_configs", "load_hf_state_dict", "make_preset_model",
    "preset_config", "resolve_model_config",
]
