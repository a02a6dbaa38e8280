"""The hooks an attnplug plugin may implement (pluggy hook specifications).

A plugin is any importable object (usually a module) that an installed distribution
names in its ``attnplug`` entry-point group::

    # the plugin distribution's pyproject.toml
    [project.entry-points.attnplug]
    my_backends = "my_package.attnplug_plugin"

and that implements one or more of the hooks below, marked with :data:`hookimpl`::

    from attnplug.plugins import hookimpl

    @hookimpl
    def attnplug_register_backends(registry):
        from my_package.backend import MyBackend
        registry.register(MyBackend)

The built-in backends register through exactly the same hook
(``attnplug.plugins.builtin``). Hook names start with ``attnplug_``; an implementation
of a hook that is not specified here is reported as a plugin fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover - import for annotations only
    from attnplug.plugins.registry import BackendRegistrar

PROJECT_NAME = "attnplug"
"""The pluggy project name; also the entry-point group plugins are found in."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks hook specifications (only this module uses it)."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's hook implementations: ``@hookimpl def attnplug_register_backends(...)``."""


@hookspec
def attnplug_register_backends(registry: "BackendRegistrar") -> None:
    """Register the plugin's attention backends.

    Called once per plugin when the registry is loaded, with a registrar bound to this
    plugin (so every backend it registers is recorded with the plugin's source). Call
    ``registry.register(BackendClass)`` once per backend; the name users select is
    ``BackendClass.get_name()``.

    Keep this hook cheap and free of hardware checks: import the backend *class* (whose
    module must import without the backend's optional packages), not its kernels. Whether
    the backend can run on this machine is its ``is_available()``.

    Args:
        registry: the registrar; its ``register(backend_cls)`` stages one
            :class:`~attnplug.core.contracts.AttentionBackend` subclass. Staged
            backends are validated after the hook returns: an invalid class, a
            duplicate name or an incompatible ``plugin_api_version`` is reported and
            skipped without affecting the plugin's other backends. If the hook raises,
            nothing it staged is registered.
    """
