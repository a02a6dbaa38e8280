"""Plugin discovery and the registry: sources, fault containment, allow/disable lists."""

from __future__ import annotations

import logging

import pytest

from attnplug import PLUGIN_API_VERSION
from attnplug.backends import BUILTIN_BACKENDS
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.core.errors import PluginValidationError, UnknownBackendError
from attnplug.plugins import get_backend, get_registry, reset_registry
from attnplug.plugins.discovery import load_registry
from attnplug.plugins.registry import BUILTIN_SOURCE, BackendRegistry, check_api_version


def _load(dists, env=None):
    return load_registry(env=env or {}, entry_points=dists.entry_points())


def test_builtins_register_through_the_hook():
    reg = load_registry(env={}, entry_points=[])
    entry = reg.entry("torch_native")
    assert entry.backend_cls is TorchNativeBackend
    assert entry.source.builtin and entry.source.describe() == "built-in"
    assert reg.plugins[0].plugin == "attnplug.builtin"
    assert reg.faults == []


def test_get_backend_goes_through_the_registry():
    assert get_backend("torch_native") is TorchNativeBackend
    with pytest.raises(UnknownBackendError, match="known backends: .*torch_native"):
        get_backend("no_such_backend")


def test_third_party_backend_is_recorded_with_its_distribution(dists, good_plugin_src):
    mod = dists.module_name("goodplug")
    dists.add("good-dist", "1.2.3", {"good": mod}, {mod: good_plugin_src("Good", "good_backend")})
    reg = _load(dists)
    entry = reg.entry("good_backend")
    assert entry.source.distribution == "good-dist" and entry.source.version == "1.2.3"
    assert entry.source.entry_point == f"good = {mod}"
    assert entry.source.describe() == "good-dist 1.2.3"
    assert reg.names() == [*BUILTIN_BACKENDS, "good_backend"]
    assert reg.faults == []


def _assert_fault(reg, plugin, dist, *needles):
    (fault,) = [f for f in reg.faults if f.plugin == plugin]
    assert fault.distribution == dist and fault.entry_point.startswith(f"{plugin} = ")
    text = str(fault)
    for needle in (plugin, fault.entry_point, dist) + needles:
        assert needle in text, (needle, text)
    return fault


def test_import_error_is_contained(dists, good_plugin_src, caplog):
    bad, good = dists.module_name("badimport"), dists.module_name("fine")
    dists.add("bad-dist", "0.1", {"bad": bad}, {bad: "import not_a_real_module_xyz\n"})
    dists.add("fine-dist", "2.0", {"fine": good}, {good: good_plugin_src("Fine", "fine_backend")})
    with caplog.at_level(logging.WARNING, logger="attnplug.plugins"):
        reg = _load(dists)
    _assert_fault(reg, "bad", "bad-dist 0.1", "ModuleNotFoundError", "not_a_real_module_xyz")
    assert "fine_backend" in reg and "torch_native" in reg
    assert any("not_a_real_module_xyz" in r.getMessage() for r in caplog.records)


def test_hook_error_discards_everything_the_plugin_staged(dists):
    mod = dists.module_name("hookraises")
    dists.add("raiser", "1.0", {"raiser": mod}, {mod: '''
        from attnplug.plugins import hookimpl
        from attnplug.backends.torch_native import TorchNativeBackend
        class Partial(TorchNativeBackend):
            @classmethod
            def get_name(cls): return "partial"
        @hookimpl
        def attnplug_register_backends(registry):
            registry.register(Partial)
            raise RuntimeError("boom in hook")
    '''})
    reg = _load(dists)
    _assert_fault(reg, "raiser", "raiser 1.0", "RuntimeError", "boom in hook")
    assert "partial" not in reg and reg.names() == [*BUILTIN_BACKENDS]


def test_duplicate_name_keeps_the_first_registration(dists, good_plugin_src):
    mod = dists.module_name("dup")
    dists.add("dup-dist", "1.0", {"dup": mod}, {mod: good_plugin_src("Dup", "torch_native")})
    reg = _load(dists)
    fault = _assert_fault(reg, "dup", "dup-dist 1.0", "already registered", "attnplug.builtin")
    assert fault.backend == "Dup"
    assert reg.entry("torch_native").source is BUILTIN_SOURCE


@pytest.mark.parametrize("registered, needle", [
    ("object()", "not a subclass of attnplug.AttentionBackend"),
    ("TorchNativeBackend()", "not a subclass"),
    ("Abstract", "does not implement the abstract methods get_builder_cls, get_impl_cls"),
    ("BadName", "get_name() returned 'has space'"),
    ("NameRaises", "get_name() raised ValueError: no name"),
])
def test_invalid_backend_objects_are_skipped(dists, good_plugin_src, registered, needle):
    mod = dists.module_name("invalid")
    dists.add("inv", "1.0", {"inv": mod}, {mod: f'''
        from attnplug.plugins import hookimpl
        from attnplug.core import AttentionBackend
        from attnplug.backends.torch_native import TorchNativeBackend
        class Abstract(AttentionBackend):
            @classmethod
            def get_name(cls): return "abstract"
        class BadName(TorchNativeBackend):
            @classmethod
            def get_name(cls): return "has space"
        class NameRaises(TorchNativeBackend):
            @classmethod
            def get_name(cls): raise ValueError("no name")
        class Valid(TorchNativeBackend):
            @classmethod
            def get_name(cls): return "valid_one"
        @hookimpl
        def attnplug_register_backends(registry):
            registry.register({registered})
            registry.register(Valid)
    '''})
    reg = _load(dists)
    _assert_fault(reg, "inv", "inv 1.0", needle)
    assert "valid_one" in reg, "a plugin's valid backends survive its invalid ones"


@pytest.mark.parametrize("declared", [(PLUGIN_API_VERSION[0] + 1, 0), (PLUGIN_API_VERSION[0], PLUGIN_API_VERSION[1] + 7)])
def test_incompatible_api_version_message_names_both_versions(dists, declared):
    mod = dists.module_name("future")
    dists.add("future-dist", "9.0", {"future": mod}, {mod: f'''
        from attnplug.plugins import hookimpl
        from attnplug.backends.torch_native import TorchNativeBackend
        class Future(TorchNativeBackend):
            plugin_api_version = {declared!r}
            @classmethod
            def get_name(cls): return "future"
        @hookimpl
        def attnplug_register_backends(registry):
            registry.register(Future)
    '''})
    reg = _load(dists)
    ours = ".".join(map(str, PLUGIN_API_VERSION))
    theirs = ".".join(map(str, declared))
    _assert_fault(reg, "future", "future-dist 9.0", f"plugin_api_version {theirs}", f"plugin API {ours}")
    assert "future" not in reg


def test_api_version_rules():
    major, minor = PLUGIN_API_VERSION
    assert check_api_version((major, minor)) is None
    if minor:
        assert check_api_version((major, 0)) is None
    assert "(major, minor) tuple" in check_api_version("1.0")
    assert check_api_version((major, minor + 1)) is not None


@pytest.mark.parametrize("source, needle", [
    ("x = 1\n", "defines no @hookimpl attnplug_register_backends"),
    ("from attnplug.plugins import hookimpl\n@hookimpl\ndef attnplug_register_backends(registry):\n    pass\n"
     "@hookimpl\ndef attnplug_typo_hook(registry):\n    pass\n", "does not define: attnplug_typo_hook"),
    ("from attnplug.plugins import hookimpl\n@hookimpl\ndef attnplug_register_backends(registry, extra):\n"
     "    pass\n", "pluggy rejected"),
])
def test_malformed_hooks_are_reported(dists, source, needle):
    mod = dists.module_name("malformed")
    dists.add("mal", "1.0", {"mal": mod}, {mod: source})
    reg = _load(dists)
    _assert_fault(reg, "mal", "mal 1.0", needle)


def test_allow_and_disable_lists(dists, good_plugin_src):
    a, b = dists.module_name("pa"), dists.module_name("pb")
    dists.add("dist-a", "1.0", {"plug_a": a}, {a: good_plugin_src("A", "backend_a")})
    dists.add("dist-b", "1.0", {"plug_b": b}, {b: good_plugin_src("B", "backend_b")})
    reg = _load(dists, {"ATTNPLUG_PLUGINS": "plug_a"})
    assert reg.names() == [*BUILTIN_BACKENDS, "backend_a"]
    assert [(s.source.plugin, s.reason) for s in reg.skipped] == [("plug_b", "not listed in ATTNPLUG_PLUGINS")]
    reg = _load(dists, {"ATTNPLUG_DISABLE_PLUGINS": "DIST_B"})  # distribution names match loosely
    assert reg.names() == [*BUILTIN_BACKENDS, "backend_a"]
    assert "disabled by ATTNPLUG_DISABLE_PLUGINS" in reg.skipped[0].reason
    reg = _load(dists, {"ATTNPLUG_PLUGINS": "plug_a, plug_b", "ATTNPLUG_DISABLE_PLUGINS": "plug_b"})
    assert reg.names() == [*BUILTIN_BACKENDS, "backend_a"], "disable wins over allow"
    reg = _load(dists, {"ATTNPLUG_PLUGINS": "plug_a,typo_plugin"})
    assert any("typo_plugin" in n and "ATTNPLUG_PLUGINS" in n for n in reg.notes)


def test_process_registry_reloads_when_the_environment_changes(dists, good_plugin_src, monkeypatch):
    mod = dists.module_name("envplug")
    dists.add("env-dist", "1.0", {"envplug": mod}, {mod: good_plugin_src("E", "env_backend")})
    reset_registry()
    try:
        assert "env_backend" in get_registry()  # found through sys.path (the dists fixture)
        monkeypatch.setenv("ATTNPLUG_DISABLE_PLUGINS", "envplug")
        assert "env_backend" not in get_registry()
        assert get_registry() is get_registry()
    finally:
        monkeypatch.undo()
        reset_registry()


def test_registry_add_changes_nothing_on_rejection():
    reg = BackendRegistry()
    reg.add(TorchNativeBackend, BUILTIN_SOURCE)
    with pytest.raises(PluginValidationError, match="already registered"):
        reg.add(TorchNativeBackend, BUILTIN_SOURCE)
    assert len(reg) == 1 and reg.faults == []
