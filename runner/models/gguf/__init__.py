"""Real weights from GGUF files: the HF config, a float32 HF state dict and the tokenizer.

``load_gguf(path_or_name)`` is the one entry point: a path to a ``.gguf`` file, or a
bundled model's name (``bundled.BUNDLED_MODELS``: ``smollm2``). The first load of a file
reads and dequantises it (``reader``) and saves the result in the weights cache
(``cache``); later loads read the cache. See docs/real-weights.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from attnplug.runner.models.gguf import cache
from attnplug.runner.models.gguf.bundled import BUNDLED_MODELS, bundled_model_path
from attnplug.runner.models.gguf.reader import GGUFError, MissingPackageError, hf_config, hf_state_dict, open_gguf
from attnplug.runner.models.gguf.reader import field as meta
from attnplug.runner.models.gguf.tokenizer import ChatTokenizer, build_tokenizer, chat_tokenizer


@dataclass
class GGUFModel:
    """What a GGUF file gives a command (data only).

    Attributes:
        path: the ``.gguf`` file read.
        config: the HF ``config.json`` dict (``model_type: llama``).
        state_dict: HF ``LlamaForCausalLM`` names -> float32 CPU tensors (HF shapes;
            without ``lm_head.weight`` when ``config["tie_word_embeddings"]``).
        tokenizer: the file's tokenizer and chat template.
        from_cache: the weights came from the cache (no dequantisation this time).
        notes: one-line remarks for the user (e.g. the cache could not be written).
    """

    path: str
    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    from_cache: bool = False
    notes: list[str] = field(default_factory=list)


def is_gguf_model(model: str | None) -> bool:
    """``model`` names a bundled real model or a ``.gguf`` path."""
    return isinstance(model, str) and (model in BUNDLED_MODELS or model.lower().endswith(".gguf"))


def resolve_path(model: str) -> str:
    """The ``.gguf`` path of ``model`` (a bundled name, or a path returned as is)."""
    return bundled_model_path(model) if model in BUNDLED_MODELS else model


def _convert(path: str) -> dict[str, Any]:
    reader = open_gguf(path)
    config = hf_config(reader, path)
    tok = build_tokenizer(reader, path)
    return {"config": config, "state_dict": hf_state_dict(reader, path, config),
            "tokenizer_json": tok.to_str(), "chat_template": meta(reader, "tokenizer.chat_template")}


def load_gguf(model: str, *, use_cache: bool = True) -> GGUFModel:
    """Load a GGUF file (or bundled model ``model``): from the cache when it holds it, else
    converted and cached.

    Raises:
        GGUFError: the file is missing, unreadable, of an unsupported architecture or
            tensor type, or carries no tokenizer (one line naming the file).
        MissingPackageError: ``gguf`` / ``tokenizers`` / the bundled model's package is
            not installed (one line saying what to install).
    """
    path = resolve_path(model)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such GGUF file")
    entry = cache.load(path) if use_cache else None
    notes: list[str] = []
    hit = entry is not None
    if entry is None:
        entry = _convert(path)
        if use_cache and (why := cache.store(path, entry)):
            notes.append(why)
    tk = _tokenizers_module()
    tok = tk.Tokenizer.from_str(entry["tokenizer_json"])
    cfg = entry["config"]
    chat = chat_tokenizer(tok, entry["chat_template"], cfg.get("bos_token_id"), cfg.get("eos_token_id"))
    return GGUFModel(path, dict(cfg), entry["state_dict"], chat, from_cache=hit, notes=notes)


def _tokenizers_module():
    try:
        import tokenizers
    except ImportError:
        raise MissingPackageError("GGUF tokenizers need the tokenizers package: pip install 'attnplug[gguf]'") from None
    return tokenizers


__all__ = ["BUNDLED_MODELS", "ChatTokenizer", "GGUFError", "GGUFModel", "MissingPackageError", "is_gguf_model",
           "load_gguf", "resolve_path"]
