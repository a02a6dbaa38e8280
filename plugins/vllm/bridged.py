"""Class paths vLLM loads: ``attnplug.plugins.vllm.bridged.<attnplug backend name>``.

vLLM's registry stores a backend as a ``"module.Class"`` string and imports it in every
process that needs it (engine core, workers); this module answers any registered
attnplug backend name with its bridge class (built once per process by
``adapter.bridge_classes``). The vLLM name it serves under comes from
``ATTNPLUG_VLLM_TARGET`` (set by ``register()``; default: the platform's choice).
"""

from __future__ import annotations

import functools
import os


@functools.cache
def bridge_for(name: str, vllm_name: str) -> type:
    """The vLLM backend class for attnplug backend ``name`` serving as ``vllm_name``."""
    from attnplug.plugins.discovery import get_registry
    from attnplug.plugins.vllm.adapter import bridge_classes

    return bridge_classes(get_registry().get(name), vllm_name)


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    from attnplug.plugins.vllm.entry import default_target

    return bridge_for(name, os.environ.get("ATTNPLUG_VLLM_TARGET") or default_target())
