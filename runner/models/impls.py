"""Creating a layer's ``AttentionImpl`` from its backend, with a clear error.

A plugin's impl constructor is third-party code: whatever it raises becomes one
:class:`~attnplug.core.errors.BackendUnsupportedError` naming the backend and the layer
(``attnplug run`` prints it as one line, exit 2) instead of a traceback from inside the
model build.
"""

from __future__ import annotations

from typing import Any

from attnplug.core.errors import AttnplugError, BackendUnsupportedError


def make_impl(backend: Any, layer_name: str, *args: Any, **kwargs: Any) -> Any:
    """``backend.get_impl_cls()(*args, **kwargs)``.

    Raises:
        BackendUnsupportedError: ``get_impl_cls`` or the constructor raised (an
            ``AttnplugError`` passes through unchanged), naming the backend and layer.
    """
    name = getattr(backend, "get_name", lambda: repr(backend))()
    try:
        return backend.get_impl_cls()(*args, **kwargs)
    except AttnplugError:
        raise
    except Exception as e:  # a plugin's own code: report it, do not crash the build
        raise BackendUnsupportedError(name, [f"its impl constructor raised {type(e).__name__}: {e}"],
                                      f"layer {layer_name!r}") from e
