"""The public API: what ``attnplug`` and ``attnplug.runner`` export, lazily.

Every exported name resolves to the object its defining module holds, ``__all__`` and
``dir()`` list it, and a bare ``import attnplug`` (or ``import attnplug.runner``) still
imports no torch (the conformance pytest plugin relies on that, see ``__init__.py``).
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import attnplug
import attnplug.core
import attnplug.runner

ENGINE_API = {
    "StepCompiler", "StepInputs", "SchedulerOutput", "NewRequestData", "CachedRequestData", "SamplingParams",
    "ModelRunner", "LLMEngine", "Scheduler", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "AttentionSpec",
    "FullAttentionSpec", "SlidingWindowSpec", "MambaSpec", "negotiate_kernel_block_sizes", "allocate_kv_caches",
    "kernel_kv_cache_spec",
}
"""What an engine author needs (``docs/embedding.md``); more names may be exported."""


def test_runner_exports_the_engine_api():
    assert ENGINE_API <= set(attnplug.runner.__all__)
    assert len(attnplug.runner.__all__) == len(set(attnplug.runner.__all__))


@pytest.mark.parametrize("name", sorted(attnplug.runner._EXPORTS))
def test_every_runner_name_resolves_to_its_defining_module(name):
    defining = importlib.import_module(attnplug.runner._EXPORTS[name])
    assert getattr(attnplug.runner, name) is getattr(defining, name)
    assert getattr(attnplug, name) is getattr(defining, name)
    assert name in dir(attnplug.runner) and name in dir(attnplug)


def test_top_level_lists_core_and_runner_names():
    names = attnplug.__all__
    assert len(names) == len(set(names)), "a name exported by both attnplug.core and attnplug.runner"
    assert set(attnplug.core.__all__) | set(attnplug.runner.__all__) | {"__version__"} == set(names)
    for name in names:
        assert getattr(attnplug, name) is not None, name
    assert set(names) <= set(dir(attnplug))
    assert attnplug.runner is importlib.import_module("attnplug.runner")


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        attnplug.NoSuchThing  # noqa: B018
    with pytest.raises(AttributeError, match="'attnplug.runner' has no attribute 'NoSuchThing'"):
        attnplug.runner.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        exec("from attnplug.runner import NoSuchThing", {})


@pytest.mark.parametrize("stmt", ["import attnplug", "import attnplug.runner",
                                  "import attnplug; attnplug.__version__; attnplug.runner"])
def test_import_does_not_import_torch(stmt):
    code = f"{stmt}\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_canary_works():
    """The check above would see torch if an export were eager."""
    code = "import attnplug\nattnplug.StepCompiler\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
