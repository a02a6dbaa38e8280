"""The converted-weights cache: a GGUF file's float32 HF state dict, HF config and tokenizer,
saved once so that later runs skip dequantisation.

Where: ``$ATTNPLUG_CACHE`` if set, else ``$XDG_CACHE_HOME/attnplug``, else
``~/.cache/attnplug`` (the XDG base-directory default); one file per GGUF file,
``gguf-<key>.pt`` (``torch.save`` of a dict; read back with ``torch.load(mmap=True,
weights_only=True)``, so only the pages used are read). The key hashes the GGUF file's
real path, size and modification time and :data:`FORMAT_VERSION`: a changed file or a new
converter makes a new entry. Writes go to a temporary file renamed into place, so a run
killed half-way leaves no broken entry. A directory that cannot be created or written is
not an error: :func:`store` returns why, and the caller runs without the cache.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
"""Bump when the converted form changes (names, permutation, dtype)."""


def cache_dir() -> Path:
    """The cache directory (module docstring); not created here."""
    if os.environ.get("ATTNPLUG_CACHE"):
        return Path(os.environ["ATTNPLUG_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnplug"


def entry_path(gguf_path: str) -> Path:
    """Where the converted form of ``gguf_path`` is (or would be) cached."""
    st = os.stat(gguf_path)
    ident = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{FORMAT_VERSION}"
    return cache_dir() / f"gguf-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.pt"


def load(gguf_path: str) -> dict[str, Any] | None:
    """The cached entry (``{"config", "state_dict", "tokenizer_json", "chat_template"}``),
    or ``None`` when there is none or it cannot be read (a damaged entry is ignored)."""
    path = entry_path(gguf_path)
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, mmap=True, weights_only=True)
    except Exception:  # a damaged or foreign file: convert again (and overwrite it)
        return None
    if not isinstance(entry, dict) or entry.get("format_version") != FORMAT_VERSION:
        return None
    return entry


def store(gguf_path: str, entry: dict[str, Any]) -> str | None:
    """Save ``entry`` for ``gguf_path``; ``None`` on success, else one line saying why not."""
    path = entry_path(gguf_path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gguf-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({**entry, "format_version": FORMAT_VERSION}, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        return f"cache directory {path.parent} is not writable ({e.strerror or e}); running without the weights cache"
    return None


__all__ = ["FORMAT_VERSION", "cache_dir", "entry_path", "load", "store"]
