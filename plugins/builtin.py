"""The built-in plugin: registers attnplug's own backends through the public hook.

Built-ins use exactly the API third-party plugins use (``attnplug_register_backends``),
so they get the same validation. They are listed in
:data:`attnplug.backends.BUILTIN_BACKENDS` as ``"module:Class"`` paths and imported
here one by one; a built-in backend whose module fails to import is reported as a fault
of this plugin and the others still register. Backend modules must therefore import
without their optional packages (triton, flash-attn, ...): the class says whether it
can run via ``is_available()``.
"""

from __future__ import annotations

import importlib

from attnplug.plugins.hookspecs import hookimpl


def _import(path: str):
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


@hookimpl
def attnplug_register_backends(registry) -> None:
    """Register every backend of :data:`attnplug.backends.BUILTIN_BACKENDS`."""
    from attnplug.backends import BUILTIN_BACKENDS

    for name, path in BUILTIN_BACKENDS.items():
        try:
            backend_cls = _import(path)
        except Exception as exc:  # contain: one broken built-in must not hide the others
            registry.report_fault(name, f"importing {path!r} raised {type(exc).__name__}: {exc}")
            continue
        registry.register(backend_cls)
