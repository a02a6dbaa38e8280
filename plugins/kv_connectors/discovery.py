"""Finding KV connectors: the built-in plugin, then entry points of ``attnplug.kv_connectors``."""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Iterable

import pluggy

from attnplug.core.errors import ConfigError
from attnplug.core.kv_connector import KVConnectorBase
from attnplug.plugins.kv_connectors import builtin, hookspecs

logger = logging.getLogger("attnplug.kv_connectors")

ENTRY_POINT_GROUP = "attnplug.kv_connectors"
"""The entry-point group third-party connectors register under."""


def discover_kv_connectors(entry_points: Iterable[importlib.metadata.EntryPoint] | None = None
                           ) -> dict[str, type[KVConnectorBase]]:
    """``{name: connector class}``: built-ins first, then entry points sorted by (distribution,
    name); a later plugin's name that is already taken is skipped with a warning, and so is a
    plugin that fails to load or registers something that is not a ``KVConnectorBase`` subclass."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    found: dict[str, type[KVConnectorBase]] = {}

    def run(plugin, source: str) -> None:
        def register(name, cls):
            if not isinstance(name, str) or not name:
                logger.warning("kv connector plugin %s: bad name %r, skipped", source, name)
            elif not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
                logger.warning("kv connector plugin %s: %r is not a KVConnectorBase subclass, skipped", source, cls)
            elif name in found:
                logger.warning("kv connector plugin %s: name %r already taken, skipped", source, name)
            else:
                found[name] = cls
        pm.register(plugin, name=source)
        try:
            pm.check_pending()  # a hook attnplug does not specify: refused
            pm.hook.attnplug_register_kv_connectors(register=register)
        finally:
            pm.unregister(plugin)

    run(builtin, "builtin")
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    eps = sorted(entry_points, key=lambda ep: (getattr(getattr(ep, "dist", None), "name", "") or "", ep.name))
    for ep in eps:
        try:
            plugin = ep.load()
            run(plugin, f"entry point {ep.name} = {ep.value}")
        except Exception as exc:
            logger.warning("kv connector plugin %s = %s failed: %s: %s", ep.name, ep.value, type(exc).__name__, exc)
    return found


def available_kv_connectors() -> list[str]:
    return sorted(discover_kv_connectors())


def get_kv_connector(name: str) -> type[KVConnectorBase]:
    """The connector class registered as ``name``.

    Raises:
        ConfigError: no such connector (origin ``--kv-connector``; the message lists the known ones).
    """
    found = discover_kv_connectors()
    if name not in found:
        raise ConfigError("--kv-connector", f"unknown KV connector {name!r}; available: {sorted(found)}")
    return found[name]


__all__ = ["ENTRY_POINT_GROUP", "available_kv_connectors", "discover_kv_connectors", "get_kv_connector"]
