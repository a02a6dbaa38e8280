"""Suite-wide rule for tests marked ``slow`` (larger CPU cases: more processes, bigger configs,
interpreter runs): they are skipped unless ``ATTNPLUG_SLOW=1`` is set or ``-m`` names them
(``pytest -m slow tests/distributed``), so ``make test`` stays within its time budget on two
cores (docs/testing.md)."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ATTNPLUG_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: set ATTNPLUG_SLOW=1 or select it with -m slow")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)
