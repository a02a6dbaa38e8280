"""Choosing the backend of each cache group: explicit choices first, then automatic.

For a cache group of kind ``kind`` whose layers look like ``layer_cfg``:

1. Walk the sources of :func:`attnplug.plugins.config.resolve_choices` (CLI > env >
   config file). In each, a per-kind choice wins over the source's overall default; an
   overall default only applies to kinds its backend serves (``kv_cache_kind``). The
   first applicable choice is *the* choice: it is checked with the backend's
   ``validate_configuration``; if it cannot serve the layer, :class:`BackendUnsupportedError`
   lists every reason. There is never a silent fallback to another backend.
2. With no explicit choice, try :data:`AUTO_PRIORITY` for the layer's device, then every
   other registered backend in registration order; the first that serves the layer wins.
   The winner and the reasons each earlier candidate was rejected are logged (INFO, logger
   ``attnplug.plugins.selection``) and returned.

Every name of every source (CLI, env, config file; every kind, even a kind no group has,
even in a source a higher one overrides) is looked up when the selector is built: a name no
plugin registered raises :class:`UnknownBackendError` listing the known names and saying
where the name was written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from attnplug.core.contracts import AttentionBackend
from attnplug.core.errors import BackendUnsupportedError, ConfigError, UnknownBackendError
from attnplug.plugins.config import CACHE_GROUP_KINDS, KIND_CACHE_KIND, BackendChoice, ChoiceSet, resolve_choices
from attnplug.plugins.discovery import get_registry
from attnplug.plugins.registry import BackendRegistry

logger = logging.getLogger("attnplug.plugins.selection")

AUTO_PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "flashinfer", "triton", "torch_native", "flashmla", "flashinfer_mla", "triton_mla",
             "torch_native_mla", "flashmla_sparse", "triton_sparse_mla", "triton_indexer", "torch_native_sparse_mla",
             "torch_native_indexer"),
    "cpu": ("cpu_sdpa", "torch_native", "triton", "torch_native_mla", "triton_mla", "torch_native_sparse_mla",
            "torch_native_indexer"),
}
"""Device type -> backend names tried first, in order, when nothing is chosen explicitly.
Names not registered are ignored; registered backends not listed are tried afterwards in
registration order (built-ins first), so a third-party backend is only picked
automatically when nothing listed here can serve the layer."""


@dataclass(frozen=True)
class Rejection:
    """A backend that cannot serve a layer, with every reason (from ``validate_configuration``)."""

    backend: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.backend}: {'; '.join(self.reasons)}"


@dataclass(frozen=True)
class SelectionResult:
    """The backend chosen for one cache group, and how.

    Attributes:
        backend_cls: the chosen backend class.
        name: its registered name.
        kind: the cache-group kind it was chosen for.
        source: ``"cli"``, ``"env"``, ``"config"`` or ``"auto"``.
        origin: where exactly (``"--backend"``, ``"env ATTNPLUG_BACKEND"``, a config path
            and key, or ``"automatic priority for cpu"``).
        rejections: for ``"auto"``, every candidate tried before the winner and why it
            was rejected (empty for explicit choices).
    """

    backend_cls: type[AttentionBackend]
    name: str
    kind: str
    source: str
    origin: str
    rejections: tuple[Rejection, ...] = ()

    def explain(self) -> str:
        """One line for the choice, then one per rejection."""
        lines = [f"{self.kind}: {self.name} ({self.origin})"]
        lines += [f"  rejected {r}" for r in self.rejections]
        return "\n".join(lines)


def describe_layer(layer_cfg: Any) -> str:
    """A short human description of an ``AttentionLayerConfig`` (or any config object)."""
    fields = ("num_heads", "num_kv_heads", "head_size", "dtype", "block_size", "sliding_window",
              "logits_soft_cap", "device")
    parts = [f"{f}={getattr(layer_cfg, f)}" for f in fields
             if hasattr(layer_cfg, f) and getattr(layer_cfg, f) is not None]
    parts += [f for f in ("has_sinks", "use_alibi", "use_alibi_sqrt", "batch_invariant") if getattr(layer_cfg, f, False)]
    if getattr(layer_cfg, "causal", True) is False:
        parts.append("non-causal")
    return ", ".join(parts) if parts else repr(layer_cfg)


def rejection_reasons(backend_cls: type[AttentionBackend], layer_cfg: Any, kind: str) -> list[str]:
    """Every reason ``backend_cls`` cannot serve a ``kind`` group of ``layer_cfg`` layers.

    Never raises: a ``validate_configuration`` that raises is itself a reason (a plugin bug
    must not break selection of other backends).
    """
    want = KIND_CACHE_KIND[kind]
    if backend_cls.kv_cache_kind != want:
        return [f"serves {backend_cls.kv_cache_kind!r} caches; {kind} groups need a backend with "
                f"kv_cache_kind {want!r}"]
    try:
        reasons = backend_cls.validate_configuration(layer_cfg)
    except Exception as exc:
        return [f"validate_configuration raised {type(exc).__name__}: {exc}"]
    return [str(r) for r in reasons or ()]


def _device_type(layer_cfg: Any) -> str:
    try:
        return torch.device(getattr(layer_cfg, "device", "cpu")).type
    except (RuntimeError, TypeError):
        return str(getattr(layer_cfg, "device", "cpu"))


class UnknownBackendChoiceError(UnknownBackendError):
    """An :class:`UnknownBackendError` for a name written in a choice source.

    Attributes:
        origin: where the name was written (``"--backend mamba=NAME"``, ``"env
            ATTNPLUG_BACKEND_MAMBA"``, ``"/work/attnplug.toml [backend] mamba"``).
    """

    def __init__(self, choice: BackendChoice, known: Sequence[str]):
        super().__init__(choice.name, known)
        self.origin = choice.origin
        where = choice.origin + choice.name if choice.origin.endswith("=") else choice.origin
        self.args = (f"unknown backend {choice.name!r} (chosen by {where}); known backends: "
                     f"{', '.join(self.known) or '(none)'}",)


class BackendSelector:
    """Selects backends for cache groups; reads the choices once (CLI, env, config file).

    Args:
        cli_choice: the ``--backend`` value (``"NAME"`` or ``"KIND=NAME,..."``), or a
            mapping ``{"default" | kind: name}``, or ``None``.
        env: environment mapping (default ``os.environ``).
        cwd: directory whose ``attnplug.toml`` / ``pyproject.toml`` is read (default: the
            working directory).
        registry: the registry to select from (default :func:`get_registry`).

    Raises:
        ConfigError: a malformed choice in any source.
        UnknownBackendError: a name in any source (any kind, even one a higher source
            overrides) that no plugin registered; the message says where it was written.
        ConfigError: also a per-kind choice whose backend serves another kind of cache
            (``mamba = "torch_native"``), whether or not the model has a group of that kind.
    """

    def __init__(self, cli_choice: str | Mapping[str, str] | None = None, *,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 registry: BackendRegistry | None = None):
        self.registry = registry if registry is not None else get_registry()
        self.choice_sets: list[ChoiceSet] = resolve_choices(cli_choice, env, cwd)
        for cs in self.choice_sets:
            for choice in cs.choices:
                if choice.name not in self.registry:
                    raise UnknownBackendChoiceError(choice, self.registry.names())
            for kind, choice in cs.per_kind.items():
                serves = self.registry.get(choice.name).kv_cache_kind
                if serves != KIND_CACHE_KIND[kind]:
                    raise ConfigError(choice.origin, f"backend {choice.name!r} serves {serves} caches, not {kind} "
                                                     f"cache groups ({KIND_CACHE_KIND[kind]} caches)")

    def explicit_choice(self, kind: str) -> BackendChoice | None:
        """The explicit choice that governs ``kind``, or ``None`` (then: automatic).

        Raises:
            UnknownBackendError: a choice names a backend no plugin registered.
        """
        for cs in self.choice_sets:
            per_kind, default = cs.for_kind(kind)
            if per_kind is not None:
                self.registry.get(per_kind.name)
                return per_kind
            if default is not None:
                backend_cls = self.registry.get(default.name)
                if backend_cls.kv_cache_kind == KIND_CACHE_KIND[kind]:
                    return default
                logger.debug("%s=%s serves %r caches; not applied to %s groups", default.origin,
                             default.name, backend_cls.kv_cache_kind, kind)
        return None

    def candidates(self, device_type: str) -> list[str]:
        """Automatic-selection order for ``device_type`` (registered names only)."""
        first = [n for n in AUTO_PRIORITY.get(device_type, ()) if n in self.registry]
        return first + [n for n in self.registry.names() if n not in first]

    def select(self, layer_cfg: Any, kind: str) -> SelectionResult:
        """The backend for a ``kind`` cache group whose layers are ``layer_cfg``.

        Args:
            layer_cfg: an :class:`~attnplug.core.contracts.AttentionLayerConfig` (or the
                config type a Mamba backend's ``validate_configuration`` takes).
            kind: one of :data:`~attnplug.plugins.config.CACHE_GROUP_KINDS`.

        Returns:
            The :class:`SelectionResult`.

        Raises:
            ConfigError: ``kind`` is not a cache-group kind.
            UnknownBackendError: an explicit choice names an unregistered backend.
            BackendUnsupportedError: the explicit choice cannot serve the layer (its
                reasons listed), or, automatically, no registered backend can (every
                candidate's reasons listed).
        """
        if kind not in CACHE_GROUP_KINDS:
            raise ConfigError("select_backend", f"unknown cache-group kind {kind!r}; valid: "
                                                f"{', '.join(CACHE_GROUP_KINDS)}")
        layer_desc = describe_layer(layer_cfg)
        choice = self.explicit_choice(kind)
        if choice is not None:
            backend_cls = self.registry.get(choice.name)
            reasons = rejection_reasons(backend_cls, layer_cfg, kind)
            if reasons:
                raise BackendUnsupportedError(
                    choice.name, reasons,
                    context=f"{kind} layers ({layer_desc}); it was chosen explicitly by {choice.origin}, "
                            "and an explicit choice never falls back to another backend")
            source = next(cs.source for cs in self.choice_sets
                          if choice in (cs.default, *cs.per_kind.values()))
            logger.info("backend for %s layers: %s (chosen by %s)", kind, choice.name, choice.origin)
            return SelectionResult(backend_cls, choice.name, kind, source, choice.origin)

        device = _device_type(layer_cfg)
        rejections: list[Rejection] = []
        for name in self.candidates(device):
            backend_cls = self.registry.get(name)
            reasons = rejection_reasons(backend_cls, layer_cfg, kind)
            if not reasons:
                origin = f"automatic priority for {device}"
                if rejections:
                    logger.info("auto-selected backend %r for %s layers (%s); rejected before it: %s",
                                name, kind, layer_desc, " | ".join(str(r) for r in rejections))
                else:
                    logger.info("auto-selected backend %r for %s layers (%s)", name, kind, layer_desc)
                return SelectionResult(backend_cls, name, kind, "auto", origin, tuple(rejections))
            rejections.append(Rejection(name, tuple(reasons)))
        raise BackendUnsupportedError(
            "(any registered backend)", [str(r) for r in rejections] or ["no backends are registered"],
            context=f"{kind} layers ({layer_desc}): no registered backend can serve them; install or "
                    "enable a plugin that can, or change the layer configuration")

    def select_groups(self, groups: Sequence[tuple[str, Any]]) -> list[SelectionResult]:
        """:meth:`select` for each ``(kind, layer_cfg)`` in ``groups``, in order."""
        return [self.select(cfg, kind) for kind, cfg in groups]


def select_backend(layer_cfg: Any, kind: str, *, cli_choice: str | Mapping[str, str] | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
                   registry: BackendRegistry | None = None) -> SelectionResult:
    """Select the backend for one cache group (see :class:`BackendSelector` and
    :meth:`BackendSelector.select` for the arguments, result and errors).

    Examples:
        >>> from attnplug.core import AttentionLayerConfig
        >>> cfg = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=64)
        >>> r = select_backend(cfg, "full_attention", cli_choice="torch_native", env={})
        >>> r.name, r.source
        ('torch_native', 'cli')
    """
    return BackendSelector(cli_choice, env=env, cwd=cwd, registry=registry).select(layer_cfg, kind)
