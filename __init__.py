"""attnplug: a pluggable attention-backend framework for LLM inference.

The step's data flow: scheduler output → input batch → prepare inputs → common
metadata → per-group builder → attention impl. See ``docs/architecture.md``.

The public names of :mod:`attnplug.core` (the backend contract, metadata, errors) and of
:mod:`attnplug.runner` (the step compiler, its inputs and outputs, ``ModelRunner``,
``LLMEngine``, ``Scheduler``, the KV-cache specs, config and helpers; see
``docs/embedding.md``) are re-exported here, *lazily* (PEP 562): a plain ``import
attnplug`` does not import torch. That keeps the conformance suite's pytest plugin
(``attnplug.plugins.conformance.pytest_plugin``, loaded by every pytest run of an
environment where attnplug is installed) cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name.startswith("__") and name != "__all__":
        raise AttributeError(name)
    runner = importlib.import_module("attnplug.runner")  # a table of names: imports no torch
    if name in runner.__all__:
        value = getattr(runner, name)
        globals()[name] = value
        return value
    if name == "runner":  # the subpackage itself, just bound by the import above
        return runner
    core = importlib.import_module("attnplug.core")
    if name == "__all__":
        return list(core.__all__) + list(runner.__all__) + ["__version__"]
    if name in core.__all__:
        value = getattr(core, name)
        globals()[name] = value
        return value
    if name in globals():  # a submodule the imports above just bound (``core``, ``runner``)
        return globals()[name]
    raise AttributeError(f"module 'attnplug' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
