"""Where the Triton kernels can run, and importing them in the mode Triton runs in.

How the installed Triton (3.x) handles ``TRITON_INTERPRET``: it reads the variable (through
``triton.knobs.runtime.interpret``) each time a function is *decorated* with
``@triton.jit``, and decides there whether the function is compiled for a GPU or run by
the interpreter on the CPU. Triton's own device library (``tl.max``, ``tl.sum``,
``tl.cdiv``, ``tl.zeros``...) is decorated when ``triton`` is first imported, and an
interpreted kernel cannot call a compiled library function (nor the reverse). So the
mode of a process is fixed by the environment at the first ``import triton``:
``TRITON_INTERPRET=1`` must be set before that (in the shell, or before anything imports
triton); setting it later has no effect except an explanation from
:func:`unavailable_reason`.

This module reads the effective mode from Triton's library (:func:`interpreting`) and
imports the kernel modules of this package decorated in that same mode
(:func:`kernel_module`), whatever the variable says by then. Nothing here imports
``triton`` at module import time: the backend class must load (and report itself
unavailable) on machines without Triton, and importing the backend must not fix the mode.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from types import ModuleType

_PACKAGE = "attnplug.backends.triton"


def triton_import_error() -> str | None:
    """``None`` when ``import triton`` works, else why it does not (one line)."""
    if "triton" in sys.modules:
        return None
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"importing triton failed ({type(exc).__name__}: {exc})"
    return None


def env_requests_interpreter() -> bool:
    """Whether ``TRITON_INTERPRET`` is set to a true value in the environment now."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter in this process.

    Before ``triton`` is imported: what ``TRITON_INTERPRET`` says now (the import will
    fix that mode). After: the mode Triton's own library was decorated in. Never raises;
    False without Triton.
    """
    if "triton" not in sys.modules:
        return env_requests_interpreter() and triton_import_error() is None
    try:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(standard.cdiv, InterpretedFunction)
    except Exception:  # an unusual Triton layout: trust the variable
        return env_requests_interpreter()


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, never raising."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _major_minor(version: str) -> tuple[int, int]:
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def interpreter_incompatibility() -> str | None:
    """Why this Triton's interpreter cannot run the kernels with this NumPy, or ``None``.

    Triton < 3.7's interpreter turns a scalar, which it keeps as a 1-element array, into a
    Python int with ``int(array)``; NumPy >= 2.4 refuses ``int()`` of a 1-d array, so every
    ``range()`` over runtime bounds in a kernel fails (Triton 3.7 squeezes the array first).
    Never raises.
    """
    try:
        import numpy
        import triton

        old_triton = _major_minor(triton.__version__) < (3, 7)
        new_numpy = _major_minor(numpy.__version__) >= (2, 4)
    except Exception:
        return None
    if old_triton and new_numpy:
        return (f"the interpreter of triton {triton.__version__} cannot run these kernels with numpy "
                f"{numpy.__version__} (it calls int() on 1-element arrays, which numpy >= 2.4 refuses); on the CPU "
                "use triton >= 3.7 or numpy < 2.4")
    return None


def unavailable_reason() -> str | None:
    """``None`` when the Triton kernels can run here, else a sentence saying why not."""
    why = triton_import_error()
    if why is not None:
        return f"{why}; install it with `pip install 'attnplug[triton]'`"
    if cuda_available():
        return None
    if interpreting():
        return interpreter_incompatibility()
    if env_requests_interpreter():
        return ("TRITON_INTERPRET=1 was set after triton was imported; Triton fixes the mode at import, "
                "so set it in the environment before the process imports triton")
    return "no CUDA device (on the CPU, set TRITON_INTERPRET=1: Triton interpreter, slow)"


def kernel_module(name: str, package: str = _PACKAGE) -> ModuleType:
    """The kernel module ``<package>.<name>``, decorated in the mode of
    :func:`interpreting` (the first import forces ``triton.knobs.runtime.interpret`` to it
    for its duration, so a variable changed after ``import triton`` cannot split the modes).

    Args:
        name: ``"attention_kernels"`` or ``"cache_kernels"`` (of this package), or a kernel
            module of ``package``.
        package: the package holding the module (default ``attnplug.backends.triton``).

    Raises:
        ImportError: Triton is not importable.
    """
    full = f"{package}.{name}"
    module = sys.modules.get(full)
    if module is not None:
        return module
    import triton

    mode = interpreting()
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = mode
        return importlib.import_module(full)


def launch(module: ModuleType, kernel_name: str, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Launch ``module.<kernel_name>[grid](*args, **kwargs)``.

    In interpreter mode the knob ``triton.knobs.runtime.interpret`` is held True for the
    launch even when the variable has been unset since ``import triton``: the interpreter
    imports parts of Triton lazily at launch and checks the knob then. Compiled launches
    go straight through (no overhead).
    """
    kernel = getattr(module, kernel_name)
    if not module.INTERPRETED:
        kernel[grid](*args, **kwargs)
        return
    import triton

    if triton.knobs.runtime.interpret:
        kernel[grid](*args, **kwargs)
        return
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        kernel[grid](*args, **kwargs)


_CAPABILITY: dict[int, int] = {}
"""Compute capability per CUDA device index, read once (:func:`compute_capability`)."""


def compute_capability(device: "torch.device") -> int | None:
    """``10 * major + minor`` of a CUDA ``device`` (cached per device index), ``None`` off CUDA.

    Raises:
        RuntimeError: a CUDA device while torch sees no CUDA (from torch).
    """
    if device.type != "cuda":
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    sm = _CAPABILITY.get(index)
    if sm is None:
        major, minor = torch.cuda.get_device_capability(index)
        sm = _CAPABILITY[index] = 10 * major + minor
    return sm


__all__ = ["compute_capability", "cuda_available", "env_requests_interpreter", "interpreter_incompatibility",
           "interpreting", "kernel_module", "launch", "triton_import_error", "unavailable_reason"]
