"""The backend registry: registered name -> backend class, with where it came from.

A :class:`BackendRegistry` is filled by :func:`attnplug.plugins.discovery.load_registry`
(built-in plugin first, then the ``attnplug`` entry points of installed distributions).
Everything that goes wrong while loading a plugin becomes a :class:`PluginFault` in
``registry.faults`` instead of an exception: one broken plugin never takes the others
down. The process-wide registry (:func:`attnplug.plugins.discovery.get_registry`) is
loaded by the discovery module; this module imports nothing else of ``attnplug.plugins``.

Validation of a registered class (:func:`check_backend_class`) is strict and collects
every problem: an :class:`~attnplug.core.contracts.AttentionBackend` subclass, not
abstract, a usable name, a ``plugin_api_version`` compatible with
:data:`~attnplug.core.contracts.PLUGIN_API_VERSION` (same major, minor not newer), and
well-formed capability declarations (:data:`DECLARATIONS`, ``features()``): a backend
declaring ``supported_devices = None`` is a fault of that backend, never an error of the
listing or of selection.
"""

from __future__ import annotations

import inspect
import os
import re
import traceback as tb
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from attnplug.core.contracts import PLUGIN_API_VERSION, AttentionBackend, AttentionType
from attnplug.core.errors import PluginValidationError, UnknownBackendError

BACKEND_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")
"""Valid backend names: a letter, then letters, digits, ``_``, ``.`` or ``-`` (no ``=``,
``,`` or ``:``, which the selection syntax uses)."""


@dataclass(frozen=True)
class PluginSource:
    """Where a plugin (and every backend it registers) comes from.

    Attributes:
        plugin: the plugin's name: the entry-point name, or ``"attnplug.builtin"``.
        entry_point: ``"name = module:attr"`` of the entry point, ``None`` for built-ins.
        distribution: the installed distribution's name, ``None`` for built-ins.
        version: that distribution's version, ``None`` for built-ins.
    """

    plugin: str
    entry_point: str | None = None
    distribution: str | None = None
    version: str | None = None

    @property
    def builtin(self) -> bool:
        return self.distribution is None

    def describe(self) -> str:
        """``"built-in"`` or ``"<distribution> <version>"``."""
        if self.builtin:
            return "built-in"
        return f"{self.distribution} {self.version}" if self.version else str(self.distribution)

    def __str__(self) -> str:
        return self.describe()


BUILTIN_SOURCE = PluginSource(plugin="attnplug.builtin")


@dataclass(frozen=True)
class RegisteredBackend:
    """One registry entry: the backend class and the plugin that registered it."""

    name: str
    backend_cls: type[AttentionBackend]
    source: PluginSource


@dataclass(frozen=True)
class PluginFault:
    """A plugin (or one of its backends) that was skipped, and why.

    Attributes:
        plugin: the plugin's name (entry-point name).
        entry_point: ``"name = module:attr"``, or ``None`` for the built-in plugin.
        distribution: ``"<name> <version>"`` of the distribution, or ``None``.
        reason: what went wrong, and how to fix it.
        backend: the backend name (or class) concerned, when the fault is about one
            registration rather than the whole plugin.
        location: ``"FILE:LINE"`` where the exception behind the fault was raised (see
            :func:`fault_location`); ``None`` for faults that are not exceptions (a bad
            declaration, a duplicate name).
        traceback: the whole formatted traceback of that exception, or ``None``.
    """

    plugin: str
    entry_point: str | None
    distribution: str | None
    reason: str
    backend: str | None = None
    location: str | None = None
    traceback: str | None = None

    @classmethod
    def from_source(cls, source: PluginSource, reason: str, backend: str | None = None,
                    exc: BaseException | None = None) -> "PluginFault":
        """The fault of ``source``; with ``exc``, its location and traceback are kept."""
        return cls(plugin=source.plugin, entry_point=source.entry_point,
                   distribution=None if source.builtin else source.describe(), reason=reason,
                   backend=backend, location=None if exc is None else fault_location(exc),
                   traceback=None if exc is None else "".join(tb.format_exception(exc)))

    def __str__(self) -> str:
        lines = [f"plugin {self.plugin!r} skipped" if self.backend is None
                 else f"plugin {self.plugin!r}: backend {self.backend} skipped"]
        lines.append(f"  entry point: {self.entry_point or '(built-in)'}")
        lines.append(f"  distribution: {self.distribution or '(built-in)'}")
        lines.append(f"  reason: {self.reason}")
        if self.location:
            lines.append(f"  raised at: {self.location}")
        return "\n".join(lines)


_MACHINERY = re.compile(r"(^<frozen |[\\/]pluggy[\\/]|[\\/]importlib[\\/])")
_LOADERS = {os.path.abspath(os.path.join(os.path.dirname(__file__), f)) for f in ("discovery.py", "registry.py")}
"""Frames of the loading machinery (importlib, pluggy, our loader), which never locate a
plugin's fault."""


def fault_location(exc: BaseException) -> str | None:
    """``"FILE:LINE"`` of the innermost frame of ``exc``'s traceback outside the loading
    machinery (importlib, pluggy, ``plugins/discovery.py``, this module): where the
    exception was raised (in the plugin's code, or in a library it called; the whole
    traceback tells which). A ``SyntaxError`` gives the file and line of the bad source.
    ``None`` when no frame is left.
    """
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in tb.extract_tb(exc.__traceback__)
              if not _MACHINERY.search(f.filename) and os.path.abspath(f.filename) not in _LOADERS]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


@dataclass(frozen=True)
class SkippedPlugin:
    """A plugin not loaded on purpose (``ATTNPLUG_PLUGINS`` / ``ATTNPLUG_DISABLE_PLUGINS``)."""

    source: PluginSource
    reason: str


def format_api_version(version: Any) -> str:
    """``(1, 0)`` -> ``"1.0"``; anything else is shown with ``repr``."""
    if isinstance(version, tuple) and all(isinstance(v, int) for v in version):
        return ".".join(str(v) for v in version)
    return repr(version)


def check_api_version(declared: Any) -> str | None:
    """Why ``declared`` is incompatible with :data:`PLUGIN_API_VERSION`, or ``None``.

    Compatible means: a ``(major, minor)`` tuple of ints with ``major`` equal to ours and
    ``minor`` not newer than ours (a backend written for 1.0 runs on 1.3; one written
    for 1.3 may use hooks 1.0 lacks; one written for 2.x assumes a different contract).
    """
    ours = format_api_version(PLUGIN_API_VERSION)
    if not (isinstance(declared, tuple) and len(declared) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in declared)):
        return (f"plugin_api_version must be a (major, minor) tuple of ints, got {declared!r}; "
                f"this attnplug implements plugin API {ours}: set "
                f"plugin_api_version = attnplug.PLUGIN_API_VERSION")
    major, minor = declared
    if major != PLUGIN_API_VERSION[0] or minor > PLUGIN_API_VERSION[1]:
        return (f"declares plugin_api_version {format_api_version(declared)}, but this attnplug "
                f"implements plugin API {ours} (compatible: major {PLUGIN_API_VERSION[0]}, minor "
                f"<= {PLUGIN_API_VERSION[1]}); install a release of the plugin built for plugin "
                f"API {PLUGIN_API_VERSION[0]}.x, or an attnplug that implements "
                f"{format_api_version(declared)}")
    return None


def check_backend_class(obj: Any) -> tuple[str | None, list[str]]:
    """Validate a registered object; returns ``(name or None, every problem found)``.

    Never raises: a plugin's ``get_name`` that raises is itself a problem.
    """
    if not (inspect.isclass(obj) and issubclass(obj, AttentionBackend)):
        return None, [f"{obj!r} is not a subclass of attnplug.AttentionBackend; register the "
                      "backend class itself (not an instance or a module)"]
    problems: list[str] = []
    if inspect.isabstract(obj):
        missing = sorted(getattr(obj, "__abstractmethods__", ()))
        problems.append(f"{obj.__qualname__} does not implement the abstract methods "
                        f"{', '.join(missing)} of AttentionBackend")
    name: str | None = None
    try:
        name = obj.get_name()
    except Exception as exc:  # a plugin bug: report it, never propagate
        problems.append(f"{obj.__qualname__}.get_name() raised {type(exc).__name__}: {exc}")
    else:
        if not isinstance(name, str) or not BACKEND_NAME_RE.match(name):
            problems.append(f"{obj.__qualname__}.get_name() returned {name!r}; a backend name must "
                            "match [A-Za-z][A-Za-z0-9_.-]* (it is used on command lines and in config)")
            name = None
    why = check_api_version(getattr(obj, "plugin_api_version", None))
    if why:
        problems.append(f"{obj.__qualname__} {why}")
    kind = getattr(obj, "kv_cache_kind", None)
    if not isinstance(kind, str) or not kind:
        problems.append(f"{obj.__qualname__}.kv_cache_kind must be a non-empty str, got {_short(kind)}")
    problems += check_declarations(obj)
    return name, problems


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


DECLARATIONS: dict[str, tuple[bool, str, Any]] = {
    "supported_dtypes": (False, "torch dtypes", lambda v: isinstance(v, torch.dtype)),
    "supported_head_sizes": (True, "positive ints", _is_positive_int),
    "supported_kernel_block_sizes": (True, "positive ints", _is_positive_int),
    "supported_devices": (False, "device type names (str)", lambda v: isinstance(v, str) and bool(v)),
    "supported_attn_types": (False, "AttentionType members", lambda v: isinstance(v, AttentionType)),
}
"""``attribute -> (None allowed, what the entries are, entry check)``: the capability
declarations of ``AttentionBackend`` (``core/contracts.py``), each a tuple or list."""


def check_declarations(obj: type) -> list[str]:
    """Every problem with ``obj``'s capability declarations (:data:`DECLARATIONS`) and
    ``features()`` (a dict of str -> bool). Never raises: an attribute or ``features()``
    that raises is itself a problem."""
    problems: list[str] = []
    for attr, (none_ok, what, ok) in DECLARATIONS.items():
        try:
            value = getattr(obj, attr)
        except Exception as exc:
            problems.append(f"{obj.__qualname__}.{attr} raised {type(exc).__name__}: {exc}")
            continue
        if value is None and none_ok:
            continue
        if not isinstance(value, (tuple, list)) or not all(ok(v) for v in value):
            problems.append(f"{obj.__qualname__}.{attr} must be a tuple of {what}"
                            f"{' or None' if none_ok else ''}, got {_short(value)}")
    try:
        feats = obj.features()
    except Exception as exc:
        problems.append(f"{obj.__qualname__}.features() raised {type(exc).__name__}: {exc}")
    else:
        if not (isinstance(feats, dict) and all(isinstance(k, str) and isinstance(v, bool) for k, v in feats.items())):
            problems.append(f"{obj.__qualname__}.features() must return a dict of str -> bool, got {_short(feats)}")
    return problems


@dataclass
class BackendRegistry:
    """Registered backends by name (registration order), plus what was skipped and why.

    Attributes:
        faults: every plugin or backend that was skipped because something was wrong.
        skipped: plugins not loaded on purpose (allow-list / disable-list).
        notes: other loading remarks (e.g. an allow-list entry that matches nothing).
        plugins: every plugin that was loaded, built-in first.
    """

    faults: list[PluginFault] = field(default_factory=list)
    skipped: list[SkippedPlugin] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plugins: list[PluginSource] = field(default_factory=list)
    _entries: dict[str, RegisteredBackend] = field(default_factory=dict)

    def add(self, backend_cls: Any, source: PluginSource) -> RegisteredBackend:
        """Validate and add one backend class. Nothing changes when it is rejected.

        Raises:
            PluginValidationError: not a valid backend, an incompatible
                ``plugin_api_version``, or a name already registered (the message names
                the plugin that holds it).
        """
        name, problems = check_backend_class(backend_cls)
        if name is not None and name in self._entries:
            holder = self._entries[name].source
            problems.append(f"backend name {name!r} is already registered by plugin {holder.plugin!r} "
                            f"({holder.describe()}); the first registration keeps the name; rename "
                            "the backend (get_name) or disable one plugin with ATTNPLUG_DISABLE_PLUGINS")
        if problems:
            raise PluginValidationError(source.plugin, "; ".join(problems))
        entry = RegisteredBackend(name=name, backend_cls=backend_cls, source=source)
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> type[AttentionBackend]:
        """The backend class registered as ``name``.

        Raises:
            UnknownBackendError: no such name; the message lists the known ones.
        """
        return self.entry(name).backend_cls

    def entry(self, name: str) -> RegisteredBackend:
        """The :class:`RegisteredBackend` for ``name`` (raises like :meth:`get`)."""
        try:
            return self._entries[name]
        except KeyError:
            pass
        err = UnknownBackendError(name, list(self._entries))
        hint = self.fault_hint(name)
        if hint:
            err.args = (f"{err.args[0]}; {hint}",)
        raise err from None

    def fault_hint(self, name: str) -> str:
        """A sentence naming the plugins that failed to load (``""`` when none did), for an
        unknown-backend message: one of them may have been meant to provide ``name``.
        Faults about that very backend come first; at most three plugins are named."""
        faults = sorted(self.faults, key=lambda f: f.backend != name)
        if not faults:
            return ""
        shown = []
        for f in faults[:3]:
            what = f"plugin {f.plugin!r}" + (f" ({f.distribution})" if f.distribution else "")
            if f.backend is not None:
                what += f", backend {f.backend}"
            shown.append(f"{what}: {f.reason}" + (f" [at {f.location}]" if f.location else ""))
        more = f" and {len(faults) - 3} more" if len(faults) > 3 else ""
        return (f"{len(faults)} plugin fault(s) while loading, which may be why: " + " | ".join(shown) + more
                + " (attnplug backends --traceback shows the tracebacks)")

    def names(self) -> list[str]:
        """Registered names, in registration order (built-ins first)."""
        return list(self._entries)

    def entries(self) -> list[RegisteredBackend]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[RegisteredBackend]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)


class BackendRegistrar:
    """What a plugin's ``attnplug_register_backends(registry)`` hook receives.

    Bound to one plugin: :meth:`register` only stages the class; the loader validates
    and adds the staged classes after the hook returns (see the hook's docstring).
    """

    def __init__(self, source: PluginSource):
        self.source = source
        self.staged: list[Any] = []
        self.reported: list[tuple[str, str]] = []

    @property
    def plugin_api_version(self) -> tuple[int, int]:
        """The plugin API version of the running attnplug (``attnplug.PLUGIN_API_VERSION``)."""
        return PLUGIN_API_VERSION

    def register(self, backend_cls: type[AttentionBackend]) -> None:
        """Stage ``backend_cls`` (an ``AttentionBackend`` subclass) for registration
        under ``backend_cls.get_name()``. Validation happens after the hook returns."""
        self.staged.append(backend_cls)

    def report_fault(self, backend: str, reason: str) -> None:
        """Record that this plugin's backend ``backend`` could not be registered (e.g. its
        module failed to import), so that ``attnplug backends`` shows it with ``reason``.
        The plugin's other backends are unaffected."""
        self.reported.append((str(backend), str(reason)))

    def __repr__(self) -> str:
        return f"<BackendRegistrar for plugin {self.source.plugin!r}>"

