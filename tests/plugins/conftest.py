"""Shared fixtures of the plugin tests: fake backends and fake installed distributions."""

from __future__ import annotations

import importlib.metadata
import itertools
import sys
import textwrap
from pathlib import Path

import pytest

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.plugins.registry import BUILTIN_SOURCE, BackendRegistry, PluginSource

_counter = itertools.count()


def fake_backend(name: str, base: type = TorchNativeBackend, **attrs) -> type:
    """A subclass of ``base`` registered as ``name``; ``attrs`` become class attributes,
    except ``supports_<x>=bool`` which become classmethods."""
    ns: dict = {"get_name": classmethod(lambda cls, _n=name: _n)}
    for key, value in attrs.items():
        if key.startswith("supports_") or key in ("is_available",):
            ns[key] = classmethod(lambda cls, _v=value: _v)
        else:
            ns[key] = value
    return type(f"Fake_{name}", (base,), ns)


def registry_of(*backends: type, source: PluginSource = BUILTIN_SOURCE) -> BackendRegistry:
    reg = BackendRegistry()
    for b in backends:
        reg.add(b, source)
    return reg


class FakeDists:
    """Writes fake installed distributions (``*.dist-info`` + modules) into one directory."""

    def __init__(self, root: Path, monkeypatch):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        monkeypatch.syspath_prepend(str(root))
        self.tag = f"t{next(_counter)}"

    def module_name(self, base: str) -> str:
        """A module name unique to this test (sys.modules is process-wide)."""
        return f"{base}_{self.tag}"

    def add(self, dist: str, version: str, entry_points: dict[str, str],
            modules: dict[str, str] | None = None) -> None:
        """``entry_points``: ``{ep_name: "module:attr" or "module"}`` in group ``attnplug``;
        ``modules``: ``{module_name: source}`` written next to the dist-info."""
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[attnplug]"] + [f"{k} = {v}" for k, v in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for mod, src in (modules or {}).items():
            (self.root / f"{mod}.py").write_text(textwrap.dedent(src))

    def entry_points(self) -> list[importlib.metadata.EntryPoint]:
        return [ep for d in importlib.metadata.distributions(path=[str(self.root)])
                for ep in d.entry_points if ep.group == "attnplug"]


@pytest.fixture
def dists(tmp_path, monkeypatch):
    fd = FakeDists(tmp_path / "site", monkeypatch)
    yield fd
    for name in [m for m in sys.modules if m.endswith(f"_{fd.tag}")]:
        del sys.modules[name]


GOOD_PLUGIN = '''
from attnplug.plugins import hookimpl
from attnplug.backends.torch_native import TorchNativeBackend

class {cls}(TorchNativeBackend):
    @classmethod
    def get_name(cls):
        return "{name}"

@hookimpl
def attnplug_register_backends(registry):
    registry.register({cls})
'''


@pytest.fixture
def make_backend():
    """``make_backend(name, **attrs)``: see :func:`fake_backend`."""
    return fake_backend


@pytest.fixture
def make_registry():
    """``make_registry(*backend_classes)``: a registry holding exactly those backends."""
    return registry_of


@pytest.fixture
def good_plugin_src():
    """``good_plugin_src(cls, name)``: source of a plugin module registering one backend."""
    return lambda cls, name: GOOD_PLUGIN.format(cls=cls, name=name)
