"""Bundled small model presets: random weights from a fixed seed, no download.

A preset is an HF-style config dict (so it goes through the same
``resolve_model_config`` path as a real ``config.json``) plus an init scale.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from attnplug.runner.models.config import ModelConfigError
from attnplug.runner.models.llama import BackendForLayer, DecoderModel
from attnplug.runner.models.loader import build_model

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 2048,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        # Wider than HF's 0.02 so that random logits have clear winners: greedy tokens
        # then do not hinge on float rounding (batch-invariance checks stay meaningful).
        "initializer_range": 0.08,
    },
    "tiny-hybrid": {
        "model_type": "attnplug_hybrid",
        "architectures": ["AttnplugHybridForCausalLM"],
        "vocab_size": 2048,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        # layers: 0 sliding window, 1 Mamba2, 2 full attention, 3 Mamba2
        "attn_layer_indices": [0, 2],
        "sliding_attn_layer_indices": [0],
        "sliding_window": 64,
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 32,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.08,
    },
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 2048,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.08,
    },
}
"""Preset name -> HF-style config dict.

* ``tiny-llama``: hidden 256, 4 layers, 8 query heads / 2 KV heads of 32, vocab 2048,
  4096 positions (about 3.4 M parameters).
* ``tiny-hybrid`` (``attnplug_hybrid``, see ``hybrid.py``): the same sizes over 4 layers —
  a sliding-window (W = 64), a Mamba2, a full-attention and a Mamba2 layer (8 heads of
  64, state 32, chunk 64) — so every step serves three kinds of cache group.
* ``tiny-qwen3-moe`` (``qwen3_moe``, see ``qwen3.py``): the tiny-llama sizes with per-head q/k
  norms, a dense first layer, then mixture-of-experts MLPs (16 experts of width 128, top-4)."""

DEFAULT_PRESET = "tiny-llama"
"""What ``--model preset`` means (``attnplug backends --explain``, ``attnplug run --model preset``)."""

RUN_PRESET = "tiny-hybrid"
"""The model ``attnplug run`` uses by default."""
DEFAULT_SEED = 0


def preset_config(name: str = DEFAULT_PRESET) -> dict[str, Any]:
    """A copy of preset ``name``'s config dict.

    Raises:
        ModelConfigError: an unknown preset (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def make_preset_model(name: str = DEFAULT_PRESET, *, backend_for_layer: BackendForLayer | None = None,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                      block_size: int = 16, seed: int = DEFAULT_SEED) -> DecoderModel:
    """Build a bundled preset with reproducible random weights.

    Args:
        name: a key of :data:`PRESETS`.
        backend_for_layer: as in :func:`build_model` (default ``torch_native``).
        dtype, device, block_size: as in :func:`build_model`.
        seed: the weights' seed; the same seed gives the same weights on any device.

    Returns:
        The model in eval mode.

    Raises:
        ModelConfigError: an unknown preset.

    Examples:
        >>> m = make_preset_model()
        >>> m.config.hidden_size, m.config.num_hidden_layers, len(m.kv_cache_specs(16))
        (256, 4, 4)
    """
    return build_model(preset_config(name), backend_for_layer=backend_for_layer, dtype=dtype,
                       device=device, block_size=block_size, seed=seed)
