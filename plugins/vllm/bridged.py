"""The class path vLLM loads: ``attnplug.plugins.vllm.bridged.selected``.

vLLM's registry stores a backend as a ``"module.Class"`` string and imports it in every
process that needs it (engine core, workers). ``selected`` is the bridge class of the
attnplug backend named by ``ATTNPLUG_VLLM_BACKEND`` -- a registered name, or
``package.module:Class`` for a backend class not installed as a plugin (validated as the
registry would) -- serving under the vLLM name in ``ATTNPLUG_VLLM_TARGET`` (set by
``entry.register()``). Built once per (backend, name) per process.
"""

from __future__ import annotations

import functools
import os

ENV_BACKEND = "ATTNPLUG_VLLM_BACKEND"
ENV_TARGET = "ATTNPLUG_VLLM_TARGET"


def default_target() -> str:
    """``CPU_ATTN`` on vLLM's CPU platform, else ``CUSTOM``."""
    from attnplug.plugins.vllm import _vllm as V

    return "CPU_ATTN" if V.current_platform.is_cpu() else "CUSTOM"


def resolve(spec: str) -> type:
    """The attnplug backend class for a registered name or ``"package.module:Class"``.

    Raises:
        UnknownBackendError: an unregistered name (the message lists the known ones).
        PluginValidationError: a ``module:Class`` that is not a valid attnplug backend.
        ImportError, AttributeError: a ``module:Class`` that cannot be imported.
    """
    from attnplug.plugins.discovery import resolve_backend_spec

    return resolve_backend_spec(spec)


@functools.cache
def bridge_for(spec: str, vllm_name: str) -> type:
    """The vLLM backend class for attnplug backend ``spec`` serving as ``vllm_name``."""
    from attnplug.plugins.vllm.adapter import bridge_classes

    return bridge_classes(resolve(spec), vllm_name)


def __getattr__(name: str) -> type:
    if name != "selected":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    spec = os.environ.get(ENV_BACKEND, "").strip()
    if not spec:
        raise AttributeError(f"{__name__}.selected: {ENV_BACKEND} is not set in this process")
    return bridge_for(spec, os.environ.get(ENV_TARGET, "").strip() or default_target())
