"""Plugins: backend discovery (pluggy), the registry, config-driven selection, and the
conformance suite (``attnplug.plugins.conformance``).

Public names (imported lazily, so that importing this package stays cheap — the
conformance suite's pytest plugin lives below it and loads in every pytest run):

* :data:`hookimpl` — marks a plugin's ``attnplug_register_backends(registry)``.
* :func:`get_registry`, :func:`reset_registry`, :func:`load_registry`,
  :class:`BackendRegistry`, :class:`RegisteredBackend`, :class:`PluginSource`,
  :class:`PluginFault` — the registry.
* :func:`get_backend` — the backend class registered under a name.
* :func:`select_backend`, :class:`SelectionResult`, :class:`Rejection`,
  :func:`parse_backend_choice`, :data:`CACHE_GROUP_KINDS` — selection.

See ``docs/writing-a-backend.md`` and ``docs/configuration.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "hookimpl": "attnplug.plugins.hookspecs",
    "hookspec": "attnplug.plugins.hookspecs",
    "BackendRegistry": "attnplug.plugins.registry",
    "BackendRegistrar": "attnplug.plugins.registry",
    "RegisteredBackend": "attnplug.plugins.registry",
    "PluginSource": "attnplug.plugins.registry",
    "PluginFault": "attnplug.plugins.registry",
    "get_registry": "attnplug.plugins.discovery",
    "reset_registry": "attnplug.plugins.discovery",
    "load_registry": "attnplug.plugins.discovery",
    "get_backend": "attnplug.plugins.discovery",
    "CACHE_GROUP_KINDS": "attnplug.plugins.config",
    "parse_backend_choice": "attnplug.plugins.config",
    "select_backend": "attnplug.plugins.selection",
    "SelectionResult": "attnplug.plugins.selection",
    "Rejection": "attnplug.plugins.selection",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnplug.plugins' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
