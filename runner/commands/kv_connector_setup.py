"""``--kv-connector NAME`` and ``--kv-connector-config``: build a run's KV connector pair
(``core/kv_connector.py``; the connectors: ``plugins/kv_connectors/``) and report it.

``kv_connector_summary(engine)`` is merged into ``attnplug run --json`` as ``kv_connector``:
``name``; ``lookups``, ``query_tokens``, ``hit_tokens``, ``hit_rate`` (the scheduler side's
lookups: tokens the store provided / tokens it could have); ``loads_finished``,
``loads_failed``; ``tokens_loaded``, ``bytes_loaded``, ``tokens_saved``, ``bytes_saved``;
``load_ms_mean`` (per load: fetch, checks, copy), ``connector_ms_per_step`` (the worker's
time in the connector hooks, mean over steps); ``faults`` (``{kind: count}``, both sides);
with ``disagg``, ``role`` and ``prompt_tokens_computed`` (prompt tokens this process ran
through the model: 0 on a consumer whose loads all succeeded).
``kv_connector_rows(summary)`` are the run table's rows.
"""

from __future__ import annotations

import json
from typing import Any

from attnplug.core.errors import ConfigError
from attnplug.core.kv_connector import KVConnectorContext, KVConnectorGroup, KVConnectorRole


def add_flags(p) -> None:
    p.add_argument("--kv-connector", default=None, metavar="NAME",
                   help="move KV blocks through a connector plugin (entry-point group attnplug.kv_connectors; "
                        "built in: redis, docs/kv-connectors.md)")
    p.add_argument("--kv-connector-config", default=None, metavar="JSON|k=v,...",
                   help='the connector\'s settings, a JSON object or key=value pairs, e.g. '
                        'url=redis://127.0.0.1:6379/0')
    p.add_argument("--kv-role", choices=("producer", "consumer"), default=None,
                   help="--kv-connector disagg under torchrun: this rank's role (rank 0 producer: prefill; "
                        "rank 1 consumer: decode); checked against the rank")


def parse_config(text: str | None) -> dict[str, Any]:
    """``--kv-connector-config``: a JSON object, or ``k=v`` pairs separated by commas (a value
    that parses as JSON is taken as such: numbers, true/false).

    Raises:
        ConfigError: not a JSON object, or a pair without ``=``.
    """
    if not text:
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("--kv-connector-config", f"not valid JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(value, dict):
            raise ConfigError("--kv-connector-config", "must be a JSON object")
        return value
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--kv-connector-config", f"{part!r} is not key=value")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def model_id(args) -> str:
    """The model's identity in a shared store: the model name (preset or path) and the seed
    its random weights come from."""
    return f"{args.model}|seed={args.seed}"


def connector_context(args, kv_cfg, backends) -> KVConnectorContext:
    from attnplug.runner.execute.kv_caches import negotiate_kernel_block_sizes
    from attnplug.runner.serve.mamba_checkpoints import mamba_block_size

    sizes = negotiate_kernel_block_sizes(kv_cfg, backends)
    bm = mamba_block_size([g.kv_cache_spec for g in kv_cfg.groups])  # a Mamba group's "block": Bm tokens
    groups = []
    for grp, backend, kbs in zip(kv_cfg.groups, backends, sizes):
        spec = grp.kv_cache_spec
        kind = str(getattr(spec.kind, "value", spec.kind))
        layout = getattr(backend, "kv_cache_layout", None) if kind != "mamba" else None
        size = bm if kind == "mamba" else spec.block_size
        groups.append(KVConnectorGroup(
            tuple(grp.layer_names), kind, size, size if kind == "mamba" else int(kbs),
            getattr(spec, "sliding_window", None), tuple(layout.dims) if layout is not None else None,
            str(getattr(spec, "dtype", "")).replace("torch.", ""), backend.get_name()))
    return KVConnectorContext(tuple(groups), model_id(args), parse_config(getattr(args, "kv_connector_config", None)))


def make_connectors(args, kv_cfg, backends, alone: bool, kv_scales: dict[str, str] | None = None):
    """``(scheduler side, worker side)`` instances of ``--kv-connector``, or ``(None, None)``
    (no flag, or the batch-of-one engine of the invariance check). ``kv_scales``: the fp8
    cache's ``{"dtype", "scales", "granularity"}`` (``kv_cache_setup.prepare_scales``), ``None``
    for a cache in the model's dtype.

    Raises:
        ConfigError: an unknown connector, bad settings, a group it cannot serve,
            asynchronous scheduling / tensor parallelism (not supported with a connector), or
            an fp8 cache whose scales are ``first_batch`` (each process computes its own, so a
            block written by another process would be read with the wrong scales).
    """
    name = getattr(args, "kv_connector", None)
    if getattr(args, "kv_role", None) and name != "disagg":
        raise ConfigError("--kv-role", "only with --kv-connector disagg")
    if not name or alone:
        if getattr(args, "kv_connector_config", None) and not name:
            raise ConfigError("--kv-connector-config", "given without --kv-connector")
        return None, None
    if getattr(args, "tensor_parallel_size", 1) > 1 or getattr(args, "pipeline_parallel_size", 1) > 1:
        raise ConfigError("--kv-connector", "not with --tensor-parallel-size / --pipeline-parallel-size > 1")
    from attnplug.plugins.kv_connectors import get_kv_connector

    cls = get_kv_connector(name)
    if kv_scales is not None and kv_scales.get("scales") == "first_batch":
        raise ConfigError("--kv-connector", f"an {kv_scales.get('dtype')} KV cache with first_batch scales (what "
                          "--kv-scales auto means without checkpoint scales): each process computes its own, so "
                          "blocks another process wrote would read back wrong; use --kv-scales unit or checkpoint")
    if any(g.kv_cache_spec.kind == "mamba" for g in kv_cfg.groups) and not getattr(args, "prefix_caching", False):
        raise ConfigError("--kv-connector", "a model with Mamba layers needs --prefix-caching with a KV connector "
                          "(its chunks are then cut at Mamba checkpoints, the states the store keeps)")
    ctx = connector_context(args, kv_cfg, backends)
    return cls(ctx, KVConnectorRole.SCHEDULER), cls(ctx, KVConnectorRole.WORKER)


def kv_connector_summary(engine) -> dict[str, Any]:
    """``{"kv_connector": ...}`` (module docstring), or ``{}`` without a connector."""
    from attnplug.runner.serve.kv_loads import connector_counters

    c = connector_counters(engine)
    if c is None:
        return {}
    loads = engine.scheduler.kv_loads
    sched = engine.scheduler.kv_connector
    step_ns = getattr(engine.runner, "kv_connector_step_ns", [])
    return {"kv_connector": {
        "name": engine.scheduler.kv_connector.name, "lookups": c["lookups"], "query_tokens": c["query_tokens"],
        "hit_tokens": c["hit_tokens"],
        "hit_rate": round(c["hit_tokens"] / c["query_tokens"], 4) if c["query_tokens"] else 0.0,
        "loads_finished": loads.num_loaded, "loads_failed": loads.num_failed,
        "tokens_loaded": c["tokens_loaded"], "bytes_loaded": c["bytes_loaded"],
        "tokens_saved": c["tokens_saved"], "bytes_saved": c["bytes_saved"],
        "load_ms_mean": round(c["load_ms_mean"], 3),
        "connector_ms_per_step": round(sum(step_ns) / len(step_ns) / 1e6, 3) if step_ns else 0.0,
        "faults": c["faults"],
        **({"role": sched.kv_role, "prompt_tokens_computed": sched.prompt_tokens_computed}
           if hasattr(sched, "kv_role") else {})}}


def kv_connector_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``(metric, value)`` rows for the run table (none without a connector)."""
    c = summary.get("kv_connector")
    if not c:
        return []
    rows = [("kv connector", c["name"]),
            ("kv store hit rate", f"{c['hit_rate']:.1%} of {c['query_tokens']} tokens"),
            ("kv tokens loaded / saved", f"{c['tokens_loaded']} / {c['tokens_saved']}"),
            ("kv bytes loaded / saved", f"{c['bytes_loaded']} / {c['bytes_saved']}"),
            ("kv loads finished / failed", f"{c['loads_finished']} / {c['loads_failed']}"),
            ("kv ms per load / per step", f"{c['load_ms_mean']:.3f} / {c['connector_ms_per_step']:.3f}")]
    if "role" in c:
        rows.append(("kv role / prompt tokens computed", f"{c['role']} / {c['prompt_tokens_computed']}"))
    if c["faults"]:
        rows.append(("kv connector faults", ", ".join(f"{k} {v}" for k, v in c["faults"].items())))
    return rows
