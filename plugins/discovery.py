"""Loading plugins into a :class:`~attnplug.plugins.registry.BackendRegistry`.

Order: the built-in plugin (``attnplug.plugins.builtin``) first, then every entry point
of the ``attnplug`` group of the installed distributions, sorted by (distribution, entry
point name) so that the winner of a name clash never depends on ``sys.path`` order of
unrelated packages. Each plugin goes through the same steps, and a failure at any step
becomes a :class:`~attnplug.plugins.registry.PluginFault` (logged as a warning) and
skips the plugin (or, for a bad registration, just that backend):

1. allow/disable lists: ``ATTNPLUG_PLUGINS`` (comma-separated; when set, only these
   plugins load) and ``ATTNPLUG_DISABLE_PLUGINS`` (never load these). An entry matches
   the entry-point name or the distribution name (case, ``-``/``_``/``.`` insensitive).
   The built-in plugin is not subject to them.
2. import (``EntryPoint.load``); 3. register with pluggy (hook signatures checked, hooks
   that attnplug does not specify rejected); 4. call the plugin's
   ``attnplug_register_backends``; 5. validate and add each staged backend.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import sys
from typing import Any, Iterable, Mapping

import pluggy

from attnplug.core.contracts import AttentionBackend
from attnplug.core.errors import PluginValidationError
from attnplug.plugins import hookspecs
from attnplug.plugins.registry import (
    BUILTIN_SOURCE,
    BackendRegistrar,
    BackendRegistry,
    PluginFault,
    PluginSource,
    SkippedPlugin,
    check_backend_class,
)

logger = logging.getLogger("attnplug.plugins")

ENV_ALLOW = "ATTNPLUG_PLUGINS"
ENV_DISABLE = "ATTNPLUG_DISABLE_PLUGINS"
HOOK = "attnplug_register_backends"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def parse_plugin_list(value: str | None) -> list[str]:
    """``"a, b c"`` -> ``["a", "b", "c"]`` (commas and/or whitespace separate names)."""
    return [p for p in re.split(r"[,\s]+", value or "") if p]


def _source_of(ep: importlib.metadata.EntryPoint) -> PluginSource:
    dist = getattr(ep, "dist", None)
    return PluginSource(plugin=ep.name, entry_point=f"{ep.name} = {ep.value}",
                        distribution=getattr(dist, "name", None) or "(unknown distribution)",
                        version=getattr(dist, "version", None))


def _discover(entry_points: Iterable[importlib.metadata.EntryPoint] | None):
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME)
    eps = list(entry_points)
    return sorted(eps, key=lambda ep: (_norm(getattr(getattr(ep, "dist", None), "name", "") or ""), ep.name))


def _matches(names: list[str], source: PluginSource) -> str | None:
    wanted = {_norm(n) for n in names}
    for candidate in (source.plugin, source.distribution or ""):
        if candidate and _norm(candidate) in wanted:
            return candidate
    return None


class _Loader:
    """Loads plugins one at a time into ``registry``, containing every fault."""

    def __init__(self, registry: BackendRegistry):
        self.registry = registry
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)

    def fault(self, source: PluginSource, reason: str, backend: str | None = None,
              exc: BaseException | None = None) -> None:
        f = PluginFault.from_source(source, reason, backend, exc)
        self.registry.faults.append(f)
        logger.warning("attnplug: %s", f)

    def load(self, plugin: Any, source: PluginSource) -> None:
        try:
            self.pm.register(plugin, name=f"{source.distribution or 'attnplug'}:{source.plugin}")
        except (pluggy.PluginValidationError, ValueError) as exc:
            self.fault(source, f"pluggy rejected the plugin object {plugin!r}: {exc}")
            return
        callers = self.pm.get_hookcallers(plugin) or []
        unknown = sorted(hc.name for hc in callers if not hc.has_spec())
        names = {hc.name for hc in callers}
        if unknown or HOOK not in names:
            self.pm.unregister(plugin)
            reason = (f"implements hooks that attnplug does not define: {', '.join(unknown)} "
                      f"(known: {HOOK})" if unknown else
                      f"defines no @hookimpl {HOOK}(registry) function, so it registers nothing; "
                      "mark the function with attnplug.plugins.hookimpl")
            self.fault(source, reason)
            return
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        caller = self.pm.subset_hook_caller(HOOK, remove_plugins=others)
        registrar = BackendRegistrar(source)
        try:
            caller(registry=registrar)
        except Exception as exc:
            self.pm.unregister(plugin)
            self.fault(source, f"its {HOOK} hook raised {type(exc).__name__}: {exc} "
                               "(nothing it registered was kept)", exc=exc)
            return
        self.registry.plugins.append(source)
        for backend, reason in registrar.reported:
            self.fault(source, reason, backend=backend)
        for backend_cls in registrar.staged:
            try:
                self.registry.add(backend_cls, source)
            except PluginValidationError as exc:
                label = getattr(backend_cls, "__qualname__", repr(backend_cls))
                self.fault(source, str(exc).split(": ", 1)[-1], backend=label)

    def load_entry_point(self, ep: importlib.metadata.EntryPoint, source: PluginSource) -> None:
        try:
            plugin = ep.load()
        except (Exception, SystemExit) as exc:
            self.fault(source, f"importing {ep.value!r} raised {type(exc).__name__}: {exc}; fix or "
                               f"uninstall {source.distribution}, or set {ENV_DISABLE}={ep.name}", exc=exc)
            return
        self.load(plugin, source)


def load_registry(*, env: Mapping[str, str] | None = None,
                  entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
                  include_builtins: bool = True) -> BackendRegistry:
    """Build a fresh registry: the built-in plugin, then every allowed entry point.

    Args:
        env: where ``ATTNPLUG_PLUGINS`` / ``ATTNPLUG_DISABLE_PLUGINS`` are read (default
            ``os.environ``).
        entry_points: the entry points to load (default: the ``attnplug`` group of every
            distribution importable from ``sys.path``); tests pass fakes.
        include_builtins: load ``attnplug.plugins.builtin`` first.

    Returns:
        The registry; ``registry.faults`` lists every plugin or backend skipped because of
        an error (each also logged as a warning on the ``attnplug.plugins`` logger); a fault
        that is an exception keeps its ``location`` (``FILE:LINE``) and ``traceback``.

    Never raises for a plugin's fault.
    """
    env = os.environ if env is None else env
    allow = parse_plugin_list(env.get(ENV_ALLOW))
    deny = parse_plugin_list(env.get(ENV_DISABLE))
    registry = BackendRegistry()
    loader = _Loader(registry)
    if include_builtins:
        from attnplug.plugins import builtin
        loader.load(builtin, BUILTIN_SOURCE)
    seen: set[str] = set()
    for ep in _discover(entry_points):
        source = _source_of(ep)
        if (hit := _matches(deny, source)) is not None:
            registry.skipped.append(SkippedPlugin(source, f"disabled by {ENV_DISABLE} ({hit!r})"))
            seen.add(_norm(hit))
            continue
        if allow:
            hit = _matches(allow, source)
            if hit is None:
                registry.skipped.append(SkippedPlugin(source, f"not listed in {ENV_ALLOW}"))
                continue
            seen.add(_norm(hit))
        loader.load_entry_point(ep, source)
    for name in allow + deny:
        if _norm(name) not in seen:
            var = ENV_ALLOW if name in allow else ENV_DISABLE
            note = f"{var} names {name!r}, but no installed plugin or distribution is called that"
            registry.notes.append(note)
            logger.warning("attnplug: %s", note)
    return registry


_CACHE: dict[tuple, BackendRegistry] = {}


def cache_key() -> tuple:
    return (os.environ.get(ENV_ALLOW), os.environ.get(ENV_DISABLE), tuple(sys.path))


def cached_registry() -> BackendRegistry:
    """The registry for the current environment and ``sys.path``, loaded once."""
    key = cache_key()
    reg = _CACHE.get(key)
    if reg is None:
        _CACHE.clear()
        reg = _CACHE[key] = load_registry()
    return reg


def clear_cache() -> None:
    _CACHE.clear()


def get_registry() -> BackendRegistry:
    """The process-wide registry, loaded on first use (see :func:`load_registry`).

    It is reloaded when ``ATTNPLUG_PLUGINS``, ``ATTNPLUG_DISABLE_PLUGINS`` or ``sys.path``
    changed since the last load; :func:`reset_registry` forces a reload.
    """
    return cached_registry()


def reset_registry() -> None:
    """Forget the process-wide registry; the next :func:`get_registry` reloads it."""
    clear_cache()


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name`` (built-in or from an installed plugin).

    Args:
        name: a registered backend name, e.g. ``"torch_native"``.

    Returns:
        The backend class (never instantiated).

    Raises:
        UnknownBackendError: no plugin registered ``name``; the message lists the known
            names (``attnplug backends`` shows them with their sources).

    Examples:
        >>> get_backend("torch_native").get_name()
        'torch_native'
    """
    return get_registry().get(name)


def resolve_backend_spec(spec: str) -> type[AttentionBackend]:
    """The backend class for a registered name or ``"package.module:Class"`` (a class that is
    not, or not yet, installed as a plugin; validated as the registry would).

    Raises:
        UnknownBackendError: an unregistered name (the message lists the known ones).
        PluginValidationError: a ``module:Class`` that is not a valid backend.
        ImportError, AttributeError: a ``module:Class`` that cannot be imported.
    """
    if ":" not in spec:
        return get_registry().get(spec)
    module_name, _, attr = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    _, problems = check_backend_class(obj)
    if problems:
        raise PluginValidationError(spec, "; ".join(problems))
    return obj
