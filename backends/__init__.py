"""Attention backends, one sub-package each.

Backends are found through the plugin registry (``attnplug.plugins``), never by
importing a backend package directly. :data:`BUILTIN_BACKENDS` lists the built-in
ones as ``"module:Class"`` paths; the built-in plugin (``attnplug.plugins.builtin``)
registers them through the same hook third-party plugins use. :func:`get_backend` is
a convenience that looks a name up in that registry.
"""

from __future__ import annotations

from attnplug.core.contracts import AttentionBackend

BUILTIN_BACKENDS: dict[str, str] = {
    "torch_native": "attnplug.backends.torch_native.backend:TorchNativeBackend",
    "mamba2_torch": "attnplug.backends.mamba2.backend:Mamba2Backend",
    "triton": "attnplug.backends.triton.backend:TritonBackend",
    "flash_attn": "attnplug.backends.flash_attn.backend:FlashAttnBackend",
    "flashinfer": "attnplug.backends.flashinfer.backend:FlashInferBackend",
}
"""Built-in backend name -> ``"module:ClassName"`` of its :class:`AttentionBackend`.

Each module must import without the backend's optional packages (the class reports
whether it can run through ``is_available()``)."""


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name`` (built-in or from an installed plugin).

    Args:
        name: a registered backend name, e.g. ``"torch_native"``.

    Returns:
        The backend class (never instantiated).

    Raises:
        UnknownBackendError: no plugin registered ``name``; the message lists the known
            names (``attnplug backends`` shows them with their sources).

    Examples:
        >>> get_backend("torch_native").get_name()
        'torch_native'
    """
    from attnplug.plugins.registry import get_registry

    return get_registry().get(name)


__all__ = ["BUILTIN_BACKENDS", "get_backend"]
