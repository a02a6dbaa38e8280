"""The exception hierarchy of attnplug.

Every error a user or a plugin can trigger is an :class:`AttnplugError`. Messages
say what failed (with the values), why it matters, and how to fix it.
"""

from __future__ import annotations

from typing import Any, Sequence


class AttnplugError(Exception):
    """Base class of every error raised by attnplug."""


class MetadataError(AttnplugError, ValueError):
    """A metadata tensor has the wrong shape, dtype, device or contents."""


class MetadataInvariantError(MetadataError):
    """One of the eight batch invariants (listed in ``attnplug.core.validation``) does not hold.

    Attributes:
        invariant: the invariant's number (1-8) and short name, e.g. ``"5 positions"``.
        row: the batch row (or token index, see the message) where it failed, or ``None``.
        values: the offending values, as a dict of name -> value.
    """

    def __init__(self, invariant: str, row: int | None, values: dict[str, Any], hint: str = ""):
        self.invariant = invariant
        self.row = row
        self.values = dict(values)
        where = "" if row is None else f" at row {row}"
        vals = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
        msg = f"invariant {invariant} violated{where}: {vals}"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)


class InvalidSchedulerOutput(AttnplugError, ValueError):
    """A ``SchedulerOutput`` cannot be applied; the runner's state is unchanged.

    Attributes:
        req_id: the request the problem concerns (``None`` for batch-wide problems).
        field: the ``SchedulerOutput`` field at fault, e.g. ``"num_scheduled_tokens"``.
    """

    def __init__(self, req_id: str | None, field: str, message: str):
        self.req_id = req_id
        self.field = field
        who = "" if req_id is None else f"request {req_id!r}: "
        super().__init__(f"{who}{field}: {message}")


class KVCacheSpecError(AttnplugError, ValueError):
    """KV-cache specs that are invalid, or cannot be grouped or merged."""


class BackendUnsupportedError(AttnplugError, ValueError):
    """A backend cannot serve a layer configuration.

    Attributes:
        backend_name: the backend's registered name.
        reasons: every human-readable reason it was rejected.
    """

    def __init__(self, backend_name: str, reasons: Sequence[str], context: str = ""):
        self.backend_name = backend_name
        self.reasons = list(reasons)
        ctx = f" for {context}" if context else ""
        lines = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(
            f"backend {backend_name!r} cannot serve{ctx}:\n{lines}\n"
            "Choose another backend (see `attnplug backends`) or change the configuration."
        )


class UnknownBackendError(AttnplugError, KeyError):
    """A backend name that no plugin registered."""

    def __init__(self, name: str, known: Sequence[str]):
        self.name = name
        self.known = sorted(known)
        super().__init__(f"unknown backend {name!r}; known backends: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return self.args[0]


class PluginValidationError(AttnplugError):
    """A plugin is invalid: it failed to import, its hook raised, or it registered something bad.

    Attributes:
        plugin: the plugin's name (entry-point name or module).
    """

    def __init__(self, plugin: str, message: str):
        self.plugin = plugin
        super().__init__(f"plugin {plugin!r}: {message}")


class ConfigError(AttnplugError, ValueError):
    """A configuration value is invalid: a backend choice on the command line, in an
    ``ATTNPLUG_*`` environment variable, or in ``attnplug.toml`` / ``[tool.attnplug]``.

    Attributes:
        origin: where the value came from (``"--backend"``, ``"env ATTNPLUG_BACKEND"``,
            ``"/path/attnplug.toml"``...).
    """

    def __init__(self, origin: str, message: str):
        self.origin = origin
        super().__init__(f"{origin}: {message}")


class TraceFormatError(AttnplugError, ValueError):
    """A trace file row is malformed or out of range."""


class InvalidRequestError(AttnplugError, ValueError):
    """A request the scheduler cannot accept (empty prompt, too long, duplicate id, ...).

    Raised by ``Scheduler.add_request`` before anything changes.

    Attributes:
        req_id: the offending request's id.
    """

    def __init__(self, req_id: str, message: str):
        self.req_id = req_id
        super().__init__(f"request {req_id!r}: {message}")


class InvalidSamplingParams(AttnplugError, ValueError):
    """A ``SamplingParams`` built with a value no request can use (``max_tokens < 1``)."""


class SchedulingError(AttnplugError, ValueError):
    """The scheduler or a block pool got bad input: an invalid config, or a call out of
    protocol (a double free, sampled tokens for a request that was not scheduled, ...).
    The state is unchanged."""


for _cls in (AttnplugError, MetadataError, MetadataInvariantError, InvalidSchedulerOutput,
             KVCacheSpecError, BackendUnsupportedError, UnknownBackendError,
             PluginValidationError, ConfigError, TraceFormatError, InvalidRequestError, SchedulingError):
    _cls.__module__ = "attnplug"
del _cls
