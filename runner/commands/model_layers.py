"""The cache groups of a model, as ``(kind, layer config, layer names)``, for ``--explain``.

``model`` is a preset name (``"preset"`` means the default preset) or a path to an HF
``config.json``. Models the runner supports go through ``attnplug.runner.models``
(``resolve_model_config`` + ``model_layer_configs``), so the groups are exactly the runner's.
Any other HF config (a hybrid the runner cannot build yet, say) is read generically:
heads, KV heads, ``head_dim``, ``attn_logit_softcapping``, and per-layer kinds from
``layer_types`` / ``layers_block_type`` / ``sliding_window`` (+ ``sliding_window_pattern``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnplug.core.contracts import AttentionLayerConfig
from attnplug.core.errors import ConfigError


@dataclass(frozen=True)
class MambaLayerConfig:
    """What selection knows about a Mamba layer before a Mamba backend defines more."""

    dtype: torch.dtype
    device: str
    block_size: int


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share a cache group (same kind and layer config)."""

    kind: str
    layer_cfg: Any
    layer_names: tuple[str, ...]


def _load(model: str) -> tuple[str, dict]:
    from attnplug.runner.models import DEFAULT_PRESET, PRESETS, preset_config

    if model == "preset":
        model = DEFAULT_PRESET
    if model in PRESETS:
        return f"preset {model!r}", preset_config(model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError("--model", f"{model!r} is neither a preset ({', '.join(['preset', *PRESETS])}) nor an "
                                     "HF config.json (or a directory holding one)")
    try:
        return str(path), json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), f"not valid JSON: {exc}") from None


def _group(per_layer: dict[str, tuple[str, Any]]) -> list[LayerGroup]:
    groups: dict[tuple[str, Any], list[str]] = {}
    for name, key in per_layer.items():
        groups.setdefault(key, []).append(name)
    return [LayerGroup(kind, cfg, tuple(names)) for (kind, cfg), names in groups.items()]


def _generic_kinds(cfg: dict, n: int) -> list[str]:
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if isinstance(types, list) and len(types) == n:
        out = []
        for t in types:
            t = str(t)
            out.append("mamba" if "mamba" in t else "sliding_window" if "sliding" in t else "full_attention")
        return out
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return ["full_attention"] * n
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_window" for i in range(n)]
    return ["sliding_window"] * n


def _generic(cfg: dict, dtype: torch.dtype, device: str, block_size: int) -> list[LayerGroup]:
    try:
        n = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_size = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError("--model", f"the HF config lacks a usable {exc}: need num_hidden_layers, "
                                     "num_attention_heads and head_dim or hidden_size") from None
    softcap = cfg.get("attn_logit_softcapping")
    per_layer = {}
    for i, kind in enumerate(_generic_kinds(cfg, n)):
        name = f"model.layers.{i}"
        if kind == "mamba":
            per_layer[f"{name}.mamba"] = (kind, MambaLayerConfig(dtype, device, block_size))
            continue
        layer = AttentionLayerConfig(
            num_heads=heads, num_kv_heads=kv, head_size=head_size, dtype=dtype, block_size=block_size,
            sliding_window=int(cfg["sliding_window"]) if kind == "sliding_window" else None,
            logits_soft_cap=float(softcap) if softcap else None, device=device)
        per_layer[f"{name}.self_attn.attn"] = (kind, layer)
    return _group(per_layer)


def model_layer_groups(model: str, *, dtype: torch.dtype | None = None, device: str = "cpu",
                       block_size: int = 16) -> tuple[str, list[LayerGroup]]:
    """``(description of the model, its cache groups)``.

    Args:
        model: ``"preset"``, a preset name, or a path to an HF ``config.json`` (or its dir).
        dtype: activation / KV dtype (default: the config's ``torch_dtype``, else float32).
        device: ``"cpu"``, ``"cuda"``...
        block_size: manager block size in tokens.

    Raises:
        ConfigError: an unknown model, or a config without the basic attention fields.
    """
    from attnplug.core.state import StateLayerConfig
    from attnplug.runner.models import UnsupportedModelError, model_layer_configs, resolve_model_config

    what, cfg = _load(model)
    if dtype is None:
        dtype = getattr(torch, str(cfg.get("torch_dtype") or "float32"), torch.float32)
    device = torch.device(device).type
    try:
        model_cfg = resolve_model_config(cfg)
    except UnsupportedModelError:
        return f"{what} (read generically: the runner has no {cfg.get('model_type')!r} model)", \
            _generic(cfg, dtype, device, block_size)
    layers = model_layer_configs(model_cfg, dtype, device, block_size)
    per_layer = {name: ("mamba" if isinstance(c, StateLayerConfig) else "mla" if hasattr(c, "kv_lora_rank")
                        else "indexer" if hasattr(c, "index_head_dim")
                        else "sliding_window" if c.sliding_window else "full_attention", c)
                 for name, c in layers.items()}
    return what, _group(per_layer)
