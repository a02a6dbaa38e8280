"""The shape of vLLM's backend interface that the bridge depends on, as plain names.

Each adapter package records the fingerprint of the minor it was written against
(``v0_32/interface.py``, ``v0_33/interface.py``); ``tests/vllm/`` compares it with the
installed vLLM, so a patch release that changes a signature fails a test naming the
change instead of failing inside an engine. Adding a minor starts here::

    python -m attnplug.plugins.vllm.fingerprint          # the installed vLLM's, as Python
    python -m attnplug.plugins.vllm.fingerprint --diff   # ... against the adapter it selects

Reading the fingerprint imports vLLM (through ``_vllm``).
"""

from __future__ import annotations

import dataclasses
import inspect
import pprint
import sys
from typing import Any


def _params(fn: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _members(cls: type) -> tuple[str, ...]:
    """Public attributes and methods ``cls`` defines or inherits from vLLM (not ``object``)."""
    return tuple(sorted(n for n in dir(cls) if not n.startswith("_") and not hasattr(object, n)))


def fingerprint() -> dict[str, tuple[str, ...]]:
    """``{what: names}`` for the installed vLLM: metadata fields, constructor and call
    parameters, backend and impl members, KV spec fields, layouts."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.plugins.vllm import _vllm as V

    return {
        "CommonAttentionMetadata fields": tuple(f.name for f in dataclasses.fields(V.VllmCommonAttentionMetadata)),
        "AttentionBackend members": _members(V.VllmAttentionBackend),
        "AttentionBackend abstract": tuple(sorted(V.VllmAttentionBackend.__abstractmethods__)),
        "AttentionImpl.__init__": _params(V.VllmAttentionImpl.__init__),
        "AttentionImpl.forward": _params(V.VllmAttentionImpl.forward),
        "AttentionImpl members": _members(V.VllmAttentionImpl),
        "AttentionMetadataBuilder.__init__": _params(V.VllmMetadataBuilder.__init__),
        "AttentionMetadataBuilder.build": _params(V.VllmMetadataBuilder.build),
        "AttentionMetadataBuilder members": _members(V.VllmMetadataBuilder),
        "FullAttentionSpec fields": tuple(f.name for f in dataclasses.fields(FullAttentionSpec)),
        "SlidingWindowSpec fields": tuple(f.name for f in dataclasses.fields(V.VllmSlidingWindowSpec)),
        "KVCacheLayout": tuple(V.KVCacheLayout.__members__),
        "Attention.__init__": _params(V.Attention.__init__),
        "get_kv_cache_configs": _params(V.get_kv_cache_configs),
    }


def differences(recorded: dict, live: dict) -> list[str]:
    """One line per entry whose names differ (``+`` added in ``live``, ``-`` gone)."""
    out = []
    for key in sorted(set(recorded) | set(live)):
        old, new = recorded.get(key, ()), live.get(key, ())
        if old != new:
            added = [n for n in new if n not in old]
            gone = [n for n in old if n not in new]
            order = "" if added or gone else " (same names, new order)"
            out.append(f"{key}: +{added} -{gone}{order}")
    return out


def main(argv: list[str]) -> int:
    """Print the installed vLLM's fingerprint (or, with ``--diff``, its differences from the
    adapter's record; exit 1 when there are some)."""
    from attnplug.plugins.vllm import _vllm as V

    live = fingerprint()
    if "--diff" in argv:
        lines = differences(V.ADAPTER.INTERFACE, live)
        print(f"vLLM {V.VLLM_VERSION} vs adapter {V.ADAPTER.__name__}: " + ("; ".join(lines) or "identical"))
        return 1 if lines else 0
    print(f"INTERFACE = {pprint.pformat(live, width=110, compact=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
