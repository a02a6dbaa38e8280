"""``--speculative`` and ``[speculative]`` in ``attnplug.toml``: reading the choice, and the
speculative-decoding part of ``attnplug run``'s summary.

The command line wins; else the config file of the working directory (``attnplug.toml``,
or ``[tool.attnplug]`` in ``pyproject.toml``, found as for ``[backend]``), in either form::

    speculative = "ngram:k=3"          # the flag's syntax

    [speculative]                      # or a table: method, then the method's keys
    method = "ngram"
    k = 3
    n = 3                              # optional (longest suffix matched)
    min_n = 1                          # optional

    [speculative]                      # a draft model (runner/execute/spec_decode/draft_model.py)
    method = "draft"
    k = 3
    model = "path/to/config.json"      # or a preset name; relative to the working directory

A bad value is one line naming the file and the key (``ConfigError``; the CLI exits 2).
"""

from __future__ import annotations

from typing import Any

from attnplug.core.errors import ConfigError
from attnplug.plugins.config import find_config
from attnplug.runner.execute.spec_decode.drafter import SpeculativeConfig, parse_speculative


def speculative_from_config(cwd=None) -> SpeculativeConfig | None:
    """The config file's ``speculative`` entry, parsed (``None`` when absent).

    Raises:
        ConfigError: not a string or a table, a table key that is not a plain int (or the
            method a string), or what ``parse_speculative`` rejects.
    """
    found = find_config(cwd)
    if found is None or not isinstance(found[1], dict) or "speculative" not in found[1]:
        return None
    path, table = found
    prefix = "[tool.attnplug.speculative]" if path.name == "pyproject.toml" else "[speculative]"
    raw = table["speculative"]
    if isinstance(raw, str):
        return parse_speculative(raw, origin=f"{path} speculative")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} speculative", f"must be a string like 'ngram:k=3' or a table, got {raw!r}")
    method = raw.get("method")
    if not isinstance(method, str):
        raise ConfigError(f"{path} {prefix} method", f"must be a string like \"ngram\", got {method!r}")
    parts = []
    for key, value in raw.items():
        if key == "method":
            continue
        if key == "model" and method == "draft":
            if not isinstance(value, str) or not value or "," in value:
                raise ConfigError(f"{path} {prefix} model", f"must be a non-empty path or preset name "
                                  f"without commas, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{path} {prefix} {key}", f"must be an integer, got {value!r}")
        parts.append(f"{key}={value}")
    return parse_speculative(f"{method}:{','.join(parts)}", origin=f"{path} {prefix}")


def resolve_speculative(flag: str | None, cwd=None) -> SpeculativeConfig | None:
    """``--speculative`` if given, else the config file's entry, else ``None``."""
    if flag is not None:
        return parse_speculative(flag)
    return speculative_from_config(cwd)


def spec_summary(engine) -> dict[str, Any]:
    """The ``speculative`` part of ``attnplug run --json``: ``None`` fields without it.

    ``tokens_per_step`` is generated tokens per engine step (both modes); with speculation
    also drafts proposed and accepted, the acceptance rate and the mean accepted length
    (tokens emitted per verification, ``SpecStats.mean_accepted_length``).
    """
    st = engine.stats
    out: dict[str, Any] = {"tokens_per_step": round(st.num_generated_tokens / st.num_steps, 3) if st.num_steps else 0.0}
    spec = engine.scheduler.spec
    if spec is None:
        out["speculative"] = None
        return out
    s = spec.stats
    out["speculative"] = {
        "method": spec.spec.method, "k": spec.spec.k,
        "draft_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_tokens,
        "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_length": round(s.mean_accepted_length, 3),
        "verifications": s.num_verifications,
    }
    if spec.spec.method == "draft":  # runner/execute/spec_decode/draft_model.py
        out["speculative"].update(draft_model=spec.spec.model, draft_model_steps=spec.drafter.num_draft_steps,
                                  draft_model_tokens=spec.drafter.num_recomputed_tokens)
    return out
