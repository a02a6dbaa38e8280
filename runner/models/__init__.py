"""Decoder models over pluggable backends: the Llama family (Llama, Qwen2, Mistral; Qwen3 and
Qwen3-MoE with per-head q/k norms and mixture-of-experts MLPs), Gemma3 (interleaved sliding
and global attention) and the Bamba hybrid (Mamba2 + attention). The shared parts: RoPE
(``rope.py``), the mixture-of-experts block (``moe.py``, ``moe_config.py``). See docs/models.md.

Build from an HF config with :func:`build_model`, load HF weights with
``model.load_hf_state_dict``, or get a bundled random-weight preset with
:func:`make_preset_model`. ``transformers`` is not needed (only the parity tests use it).
"""

from attnplug.runner.models.bamba import BambaModel, mamba_layer_name
from attnplug.runner.models.bamba_config import BambaModelConfig
from attnplug.runner.models.config import DecoderModelConfig, ModelConfigError, RopeScaling
from attnplug.runner.models.gemma3 import Gemma3Model
from attnplug.runner.models.gemma3_config import Gemma3ModelConfig
from attnplug.runner.models.llama import DecoderModel, attention_layer_name, layer_configs
from attnplug.runner.models.loader import build_model, model_layer_configs
from attnplug.runner.models.moe import MoEBlock
from attnplug.runner.models.moe_config import MoEConfig
from attnplug.runner.models.qwen3 import Qwen3Model
from attnplug.runner.models.qwen3_config import Qwen3ModelConfig
from attnplug.runner.models.presets import DEFAULT_PRESET, PRESETS, make_preset_model, preset_config
from attnplug.runner.models.registry import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    UnsupportedModelError,
    resolve_model_config,
)
from attnplug.runner.models.weights import WeightLoadError, load_hf_state_dict

__all__ = [
    "BambaModel", "BambaModelConfig", "mamba_layer_name", "model_layer_configs", "Gemma3Model", "Gemma3ModelConfig",
    "MoEBlock", "MoEConfig", "Qwen3Model", "Qwen3ModelConfig",
    "DEFAULT_PRESET", "PRESETS", "SUPPORTED_ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "DecoderModel",
    "DecoderModelConfig", "ModelConfigError", "RopeScaling", "UnsupportedModelError", "WeightLoadError",
    "attention_layer_name", "build_model", "layer_configs", "load_hf_state_dict", "make_preset_model",
    "preset_config", "resolve_model_config",
]
