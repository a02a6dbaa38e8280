"""Device identity: ``"cuda"`` and ``"cuda:0"`` name the same GPU, but torch compares them unequal.

``torch.device("cuda")`` has no index, while every tensor on it reports one
(``torch.empty(1, device="cuda").device == torch.device("cuda:0")``), and
``torch.device("cuda") != torch.device("cuda:0")``. Components that keep a device and
later check tensors against it therefore resolve it once with :func:`resolve_device`, and
checks compare with :func:`same_device`.
"""

from __future__ import annotations

import torch


def resolve_device(device: torch.device | str | int) -> torch.device:
    """``device`` with the current index filled in for an accelerator named without one.

    ``"cuda"`` becomes ``cuda:<torch.cuda.current_device()>`` (likewise for any backend
    module with ``is_available()``/``current_device()``, e.g. ``xpu``); ``cpu``, ``meta``, an
    indexed device, or an accelerator that is not available are returned as given (so a
    CPU-only process never initialises CUDA here).

    Raises:
        RuntimeError: for a string torch cannot parse as a device.
    """
    dev = torch.device(device)
    if dev.index is not None or dev.type in ("cpu", "meta"):
        return dev
    module = getattr(torch, dev.type, None)
    available = getattr(module, "is_available", None)
    current = getattr(module, "current_device", None)
    if callable(available) and callable(current) and available():
        return torch.device(dev.type, current())
    return dev


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` are the same device once resolved (``"cuda"`` == ``"cuda:0"``
    while 0 is the current device)."""
    return resolve_device(a) == resolve_device(b)


__all__ = ["resolve_device", "same_device"]
