"""Where backend choices come from: the CLI, the environment, and the config file.

Three sources, highest precedence first (``docs/configuration.md`` is the user guide):

1. the command line: ``--backend NAME`` or ``--backend KIND=NAME[,KIND=NAME...]``;
2. the environment: ``ATTNPLUG_BACKEND`` (same syntax as the flag) and one variable per
   cache-group kind, ``ATTNPLUG_BACKEND_FULL_ATTENTION``, ``ATTNPLUG_BACKEND_SLIDING_WINDOW``,
   ``ATTNPLUG_BACKEND_MAMBA``, ``ATTNPLUG_BACKEND_MLA`` (a single name each; they beat ``ATTNPLUG_BACKEND``'s entries);
3. the config file of the working directory: ``attnplug.toml`` or, when that file does
   not exist, the ``[tool.attnplug]`` table of ``pyproject.toml``::

       [backend]                       # in pyproject.toml: [tool.attnplug.backend]
       default = "torch_native"        # every kind the backend serves
       full_attention = "triton"       # per cache-group kind
       sliding_window = "triton"
       mamba = "mamba_torch"

   (``backend = "NAME"`` at the top level is short for ``[backend] default = "NAME"``.)

Each source yields a :class:`ChoiceSet`: an optional overall default plus per-kind
choices. Values are parsed and checked here (syntax, kind names); whether the named
backends exist and can serve a layer is :mod:`attnplug.plugins.selection`'s job.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from attnplug.cache_groups.kinds import GROUP_KIND_NAMES
from attnplug.core.errors import ConfigError

CACHE_GROUP_KINDS: tuple[str, ...] = GROUP_KIND_NAMES
"""Cache-group kinds a backend is selected for (``KVCacheSpec.kind``; defined once in
``attnplug.cache_groups.kinds``)."""

KIND_CACHE_KIND: dict[str, str] = {"full_attention": "attention", "sliding_window": "attention",
                                   "mamba": "mamba", "mla": "mla",
                                   "indexer": "indexer"}
"""Which ``AttentionBackend.kv_cache_kind`` serves each cache-group kind."""

DEFAULT_KEY = "default"
ENV_BACKEND = "ATTNPLUG_BACKEND"
CONFIG_FILE = "attnplug.toml"


def env_var_for(kind: str) -> str:
    """``"mamba"`` -> ``"ATTNPLUG_BACKEND_MAMBA"``."""
    return f"{ENV_BACKEND}_{kind.upper()}"


@dataclass(frozen=True)
class BackendChoice:
    """One explicit choice of a backend name.

    Attributes:
        name: the backend name as written.
        origin: where it was written, for messages (``"--backend"``,
            ``"env ATTNPLUG_BACKEND_MAMBA"``, ``"/work/attnplug.toml [backend] mamba"``).
        per_kind: True when it names the cache-group kind it applies to (strict: it must
            serve that kind); False for an overall default, which applies only to the kinds
            its backend serves (an attention backend is no choice for Mamba groups).
    """

    name: str
    origin: str
    per_kind: bool


@dataclass(frozen=True)
class ChoiceSet:
    """The choices one source makes: ``source`` is ``"cli"``, ``"env"`` or ``"config"``."""

    source: str
    default: BackendChoice | None = None
    per_kind: Mapping[str, BackendChoice] = field(default_factory=dict)

    def for_kind(self, kind: str) -> tuple[BackendChoice | None, BackendChoice | None]:
        """``(per-kind choice, default choice)`` of this source for ``kind``."""
        return self.per_kind.get(kind), self.default

    @property
    def empty(self) -> bool:
        return self.default is None and not self.per_kind

    @property
    def choices(self) -> tuple[BackendChoice, ...]:
        """Every choice of this source: the default (if any), then the per-kind ones."""
        return ((self.default,) if self.default is not None else ()) + tuple(self.per_kind.values())


def _check_name(name: Any, origin: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(origin, f"expected a backend name (a non-empty string), got {name!r}; "
                                  "`attnplug backends` lists the registered names")
    return name.strip()


def _check_kind(kind: str, origin: str) -> str:
    if kind not in CACHE_GROUP_KINDS:
        raise ConfigError(origin, f"unknown cache-group kind {kind!r}; valid: "
                                  f"{', '.join((DEFAULT_KEY,) + CACHE_GROUP_KINDS)}")
    return kind


def parse_backend_choice(text: str, origin: str = "--backend") -> dict[str, str]:
    """Parse the ``--backend`` / ``ATTNPLUG_BACKEND`` syntax.

    Args:
        text: ``"NAME"`` (overall default) or comma-separated ``KIND=NAME`` pairs, where
            ``KIND`` is ``default`` or one of :data:`CACHE_GROUP_KINDS`; e.g.
            ``"triton"``, ``"full_attention=triton,mamba=mamba_torch"``.
        origin: named in error messages.

    Returns:
        ``{"default" or kind: name}``.

    Raises:
        ConfigError: an empty entry, an unknown kind, or a kind given twice.

    Examples:
        >>> parse_backend_choice("triton")
        {'default': 'triton'}
        >>> parse_backend_choice("full_attention=triton, mamba=mamba_torch")
        {'full_attention': 'triton', 'mamba': 'mamba_torch'}
    """
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ConfigError(origin, f"empty entry in {text!r}; write NAME or KIND=NAME[,KIND=NAME]")
        kind, sep, name = part.partition("=")
        kind = kind.strip() if sep else DEFAULT_KEY
        name = name if sep else part
        if kind != DEFAULT_KEY:
            _check_kind(kind, origin)
        if kind in out:
            raise ConfigError(origin, f"{kind!r} is given twice in {text!r}")
        out[kind] = _check_name(name, origin)
    return out


def _choice_set(source: str, values: Mapping[str, str], origins: Mapping[str, str]) -> ChoiceSet:
    default = None
    if DEFAULT_KEY in values:
        default = BackendChoice(values[DEFAULT_KEY], origins[DEFAULT_KEY], per_kind=False)
    per_kind = {k: BackendChoice(v, origins[k], per_kind=True) for k, v in values.items() if k != DEFAULT_KEY}
    return ChoiceSet(source, default, per_kind)


def choices_from_cli(cli_choice: str | Mapping[str, str] | None) -> ChoiceSet:
    """The CLI's choices: ``None``, the ``--backend`` text, or an already-parsed mapping."""
    if cli_choice is None or cli_choice == "":
        return ChoiceSet("cli")
    origin = "--backend"
    if isinstance(cli_choice, str):
        values = parse_backend_choice(cli_choice, origin)
    else:
        values = {(k if k == DEFAULT_KEY else _check_kind(k, origin)): _check_name(v, origin)
                  for k, v in cli_choice.items()}
    return _choice_set("cli", values, {k: origin if k == DEFAULT_KEY else f"{origin} {k}={v}" for k, v in values.items()})


def choices_from_env(env: Mapping[str, str]) -> ChoiceSet:
    """The environment's choices (empty variables count as unset)."""
    values: dict[str, str] = {}
    origins: dict[str, str] = {}
    text = env.get(ENV_BACKEND, "").strip()
    if text:
        for k, v in parse_backend_choice(text, f"env {ENV_BACKEND}").items():
            values[k], origins[k] = v, f"env {ENV_BACKEND}"
    for kind in CACHE_GROUP_KINDS:
        var = env_var_for(kind)
        text = env.get(var, "").strip()
        if text:
            if "=" in text or "," in text:
                raise ConfigError(f"env {var}", f"expected a single backend name, got {text!r}")
            values[kind], origins[kind] = text, f"env {var}"
    return _choice_set("env", values, origins)


def find_config(cwd: str | os.PathLike | None = None) -> tuple[Path, dict] | None:
    """The config file of ``cwd`` (default: the working directory) and its attnplug table.

    Returns:
        ``(path, table)`` for ``attnplug.toml`` (the whole file), else for
        ``pyproject.toml`` when it has a ``[tool.attnplug]`` table; ``None`` when neither.

    Raises:
        ConfigError: a file that is not valid TOML (the message gives the parser's line).
    """
    base = Path(cwd) if cwd is not None else Path.cwd()
    for path, pick in ((base / CONFIG_FILE, lambda d: d),
                       (base / "pyproject.toml", lambda d: d.get("tool", {}).get("attnplug"))):
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(str(path), f"not valid TOML: {exc}; fix the file or remove it") from None
        table = pick(data)
        if table is not None:
            return path, table
    return None


def choices_from_config(cwd: str | os.PathLike | None = None) -> ChoiceSet:
    """The config file's choices (see the module docstring for the format).

    Raises:
        ConfigError: invalid TOML, a ``backend`` entry that is neither a string nor a
            table, an unknown key in the table, or a value that is not a name.
    """
    found = find_config(cwd)
    if found is None:
        return ChoiceSet("config")
    path, table = found
    prefix = "[tool.attnplug.backend]" if path.name == "pyproject.toml" else "[backend]"
    if not isinstance(table, dict):
        raise ConfigError(str(path), f"[tool.attnplug] must be a table, got {table!r}")
    raw = table.get("backend")
    if raw is None:
        return ChoiceSet("config")
    if isinstance(raw, str):
        raw = {DEFAULT_KEY: raw}
    if not isinstance(raw, dict):
        raise ConfigError(str(path), f"'backend' must be a name or a table, got {raw!r}")
    values: dict[str, str] = {}
    origins: dict[str, str] = {}
    for key, name in raw.items():
        origin = f"{path} {prefix} {key}"
        if key != DEFAULT_KEY:
            _check_kind(key, origin)
        values[key], origins[key] = _check_name(name, origin), origin
    return _choice_set("config", values, origins)


def resolve_choices(cli_choice: str | Mapping[str, str] | None = None,
                    env: Mapping[str, str] | None = None,
                    cwd: str | os.PathLike | None = None) -> list[ChoiceSet]:
    """Every source's choices, highest precedence first: CLI, environment, config file.

    Raises:
        ConfigError: any source is malformed (checked eagerly, even when a higher source
            would win: a broken config should never go unnoticed).
    """
    env = os.environ if env is None else env
    return [choices_from_cli(cli_choice), choices_from_env(env), choices_from_config(cwd)]
