"""Attention backends, one sub-package each.

:func:`get_backend` is a deliberately tiny built-in lookup over :data:`BUILTIN_BACKENDS`
(name -> ``"module:Class"``, imported lazily). It is a stopgap: the pluggy registry in
``attnplug.plugins`` replaces it as the way backends are found, and will itself list
these built-ins. Code that selects backends should go through that registry once it
exists; this function stays only for the built-ins.
"""

from __future__ import annotations

import importlib

from attnplug.core.contracts import AttentionBackend
from attnplug.core.errors import UnknownBackendError

BUILTIN_BACKENDS: dict[str, str] = {
    "torch_native": "attnplug.backends.torch_native.backend:TorchNativeBackend",
}
"""Built-in backend name -> ``"module:ClassName"`` of its :class:`AttentionBackend`."""


def get_backend(name: str) -> type[AttentionBackend]:
    """The built-in backend class registered as ``name``.

    Args:
        name: a key of :data:`BUILTIN_BACKENDS`, e.g. ``"torch_native"``.

    Returns:
        The backend class (never instantiated).

    Raises:
        UnknownBackendError: ``name`` is not a built-in backend; the message lists them.

    Examples:
        >>> get_backend("torch_native").get_name()
        'torch_native'
    """
    if name not in BUILTIN_BACKENDS:
        raise UnknownBackendError(name, BUILTIN_BACKENDS)
    module_name, cls_name = BUILTIN_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


__all__ = ["BUILTIN_BACKENDS", "get_backend"]
