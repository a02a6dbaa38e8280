"""The ``vllm.general_plugins`` entry point: ``register()``.

vLLM calls every ``vllm.general_plugins`` entry point once in each of its processes
(engine and workers), so ``register()`` runs wherever attention runs. It does nothing
unless a backend is chosen:

* ``ATTNPLUG_VLLM_BACKEND=NAME``: a registered attnplug backend (``attnplug backends``),
  or ``package.module:Class``;
* ``ATTNPLUG_VLLM_TARGET=ENUM`` (optional): the ``AttentionBackendEnum`` member it
  replaces. Default: ``CPU_ATTN`` on vLLM's CPU platform (which picks ``CPU_ATTN``
  whatever is asked, ``platforms/cpu.py``), else ``CUSTOM`` (select it with vLLM's
  ``attention_config={"backend": "CUSTOM"}``).

Raises (from ``register``, so vLLM fails at start, not mid-generation):
    UnsupportedVllmVersion: vLLM not of a supported minor (``versions.SUPPORTED_MINORS``).
    UnknownBackendError: ``NAME`` is not a registered attnplug backend.
    PluginValidationError, ImportError: a ``module:Class`` that is not a usable backend.
    ValueError: ``ENUM`` is not an ``AttentionBackendEnum`` member.
"""

from __future__ import annotations

import os

from attnplug.plugins.vllm.bridged import ENV_BACKEND, ENV_TARGET, default_target, resolve

__all__ = ["ENV_BACKEND", "ENV_TARGET", "default_target", "register"]


def register() -> str | None:
    """Register the chosen attnplug backend with vLLM; returns the class path registered
    (``None`` when ``ATTNPLUG_VLLM_BACKEND`` is unset)."""
    name = os.environ.get(ENV_BACKEND, "").strip()
    if not name:
        return None
    from attnplug.plugins.vllm import _vllm as V

    resolve(name)  # fail here, at start: UnknownBackendError names the known ones
    target = os.environ.get(ENV_TARGET, "").strip() or default_target()
    if target not in V.AttentionBackendEnum.__members__:
        raise ValueError(f"{ENV_TARGET}={target!r} is not a vLLM AttentionBackendEnum member (known: "
                         f"{', '.join(V.AttentionBackendEnum.__members__)})")
    os.environ[ENV_TARGET] = target  # bridged.py serves under this name in this process
    path = "attnplug.plugins.vllm.bridged.selected"
    V.register_backend(V.AttentionBackendEnum[target], path)
    return path
