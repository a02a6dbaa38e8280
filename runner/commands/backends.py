"""``attnplug backends``: the registered backends, and ``--explain`` for a model's selection.

::

    attnplug backends                       # table: name, source, available (or why not), features
    attnplug backends --json                # the same, machine-readable, plus plugin faults
    attnplug backends --traceback           # ... and each plugin fault's whole traceback
    attnplug backends --strict              # exit 3 if any plugin faulted
    attnplug backends --matrix              # the built-ins' feature matrix (docs/feature-matrix.md)
    attnplug backends --explain --model preset [--backend CHOICE] [--device cuda] [--dtype float16]
                                            # per cache group: the chosen backend, every rejection

Exit status: 0; 1 when ``--explain`` finds a cache group no backend can serve (or whose
explicit choice cannot serve it); 2 for bad arguments or configuration; 3 with
``--strict`` when a plugin or backend was skipped because of a fault.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from attnplug.core.errors import AttnplugError, BackendUnsupportedError
from attnplug.runner.commands.limits import OneLineParser, bounded_int

BLOCK_SIZE_LIMITS = (1, 2**16)
"""``--block-size`` range: ``attnplug run``'s (``run.FLAG_LIMITS``)."""

EXIT_PLUGIN_FAULT = 3
"""``--strict``: at least one plugin fault."""


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="attnplug backends", description=__doc__.split("::")[0].strip(),
                      epilog=__doc__.split("\n\n")[-1].strip().replace("``", ""))
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--explain", action="store_true", help="explain backend selection for --model")
    p.add_argument("--matrix", action="store_true",
                   help="print the built-in backends' feature matrix as Markdown (docs/feature-matrix.md)")
    p.add_argument("--model", default=None, help="'preset', a preset name, or a path to an HF config.json")
    p.add_argument("--backend", default=None, help="as `attnplug run --backend`: NAME or KIND=NAME[,KIND=NAME]")
    p.add_argument("--device", default=None, help="device the model would run on (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="activation/KV dtype (default: the config's torch_dtype, else float32)")
    low, high = BLOCK_SIZE_LIMITS
    p.add_argument("--block-size", type=bounded_int(low, high), default=16, metavar="N",
                   help=f"manager block size in tokens; an integer in [{low}, {high}], as `attnplug run`'s")
    p.add_argument("--traceback", action="store_true", help="print each plugin fault's whole traceback")
    p.add_argument("--strict", action="store_true",
                   help=f"exit {EXIT_PLUGIN_FAULT} if any plugin or backend was skipped because of a fault")
    return p


def _dtype_names(dtypes) -> list[str]:
    return [str(d).replace("torch.", "") for d in dtypes]


def backend_rows(registry) -> list[dict[str, Any]]:
    """One JSON-able dict per registered backend (what the table shows).

    Never raises for a backend: the registry refuses malformed declarations
    (``plugins/registry.check_declarations``, listed as faults), and a backend whose row
    still cannot be made (a declaration that changed, or raises, after registration) is
    listed as unavailable with the exception as its reason.
    """
    rows = []
    for entry in registry:
        try:
            rows.append(_row(entry))
        except Exception as exc:  # a plugin bug must not break the listing
            src = entry.source
            rows.append({
                "name": entry.name, "source": src.describe(), "builtin": src.builtin,
                "distribution": src.distribution, "version": src.version, "entry_point": src.entry_point,
                "available": False, "unavailable_reason": f"its declarations raised {type(exc).__name__}: {exc}",
                "kv_cache_kind": "?", "features": {}, "dtypes": [], "head_sizes": None, "kernel_block_sizes": None,
                "devices": [], "plugin_api_version": "?", "class": repr(entry.backend_cls)})
    return rows


def _row(entry) -> dict[str, Any]:
    cls = entry.backend_cls
    try:
        ok, why = cls.is_available()
    except Exception as exc:  # a plugin bug must not break the listing
        ok, why = False, f"is_available() raised {type(exc).__name__}: {exc}"
    try:
        feats = dict(cls.features())
    except Exception as exc:
        feats = {"error": f"features() raised {type(exc).__name__}: {exc}"}
    src = entry.source
    return {
        "name": entry.name, "source": src.describe(), "builtin": src.builtin,
        "distribution": src.distribution, "version": src.version, "entry_point": src.entry_point,
        "available": bool(ok), "unavailable_reason": "" if ok else why,
        "kv_cache_kind": cls.kv_cache_kind, "features": feats,
        "dtypes": _dtype_names(cls.supported_dtypes),
        "head_sizes": None if cls.supported_head_sizes is None else list(cls.supported_head_sizes),
        "kernel_block_sizes": (None if cls.supported_kernel_block_sizes is None
                               else list(cls.supported_kernel_block_sizes)),
        "devices": list(cls.supported_devices),
        "capabilities": _capabilities(cls),
        "plugin_api_version": ".".join(map(str, cls.plugin_api_version)),
        "class": f"{cls.__module__}.{cls.__qualname__}",
    }


def _capabilities(cls) -> dict[str, Any]:
    """``BackendCapabilities.of(cls).to_dict()`` (core/capabilities.py), or the error it raised."""
    from attnplug.core.capabilities import BackendCapabilities

    try:
        return BackendCapabilities.of(cls).to_dict()
    except Exception as exc:  # a plugin bug must not break the listing
        return {"error": f"its declarations raised {type(exc).__name__}: {exc}"}


def _problems(registry) -> dict[str, list]:
    return {
        "faults": [{"plugin": f.plugin, "entry_point": f.entry_point, "distribution": f.distribution,
                    "backend": f.backend, "reason": f.reason, "location": f.location,
                    "traceback": f.traceback} for f in registry.faults],
        "skipped": [{"plugin": s.source.plugin, "distribution": s.source.describe(), "reason": s.reason}
                    for s in registry.skipped],
        "notes": list(registry.notes),
    }


TABLE_WIDTH = 100
"""Columns the tables are laid out in when stdout is not a terminal (``COLUMNS`` overrides)."""

FEATURE_ABBREV = {"sliding_window": "window", "logits_soft_cap": "softcap", "mqa_gqa": "gqa",
                  "batch_invariant": "batch-inv"}
"""Short names of ``features()`` keys in the table (the declared ones are listed)."""
DTYPE_ABBREV = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _console():
    import os

    from attnplug.runner.commands.report import Console

    console = Console()
    if not console.is_terminal:
        cols = os.environ.get("COLUMNS", "")
        console = Console(width=int(cols) if cols.isdigit() and int(cols) > 0 else TABLE_WIDTH)
    return console


def compact_sizes(sizes: list[int] | None) -> str:
    """``"any"``, ``"16, 32, 64"``, or an arithmetic run of 4 or more as ``"8..256 step 8"``."""
    if sizes is None:
        return "any"
    if len(sizes) >= 4:
        step = sizes[1] - sizes[0]
        if step > 0 and all(b - a == step for a, b in zip(sizes, sizes[1:])):
            return f"{sizes[0]}..{sizes[-1]} step {step}"
    return ", ".join(map(str, sizes))


def print_backends(registry, show_traceback: bool = False) -> None:
    """The backends table (abbreviated to fit :data:`TABLE_WIDTH` columns: ``--json`` has
    the full names; why a backend is unavailable is a numbered note under it), then the
    plugin faults, each with where it raised, and with
    ``show_traceback`` each fault's whole traceback."""
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    table = Table(title="attnplug backends", show_lines=False)
    for col in ("name", "source", "available", "kind", "features", "dtypes", "head sizes", "kernel blocks", "API"):
        table.add_column(col, overflow="fold", no_wrap=col in ("name", "source", "kind", "available"))  # short words stay whole
    why_not: list[str] = []
    for r in backend_rows(registry):
        feats = " ".join(FEATURE_ABBREV.get(k, k) for k, v in r["features"].items() if v) or "-"
        if not r["available"]:
            why_not.append(f"[{len(why_not) + 1}] {r['name']}: {r['unavailable_reason']}")
        avail = "[green]yes[/green]" if r["available"] else f"[red]no[/red] [{len(why_not)}]"
        table.add_row(escape(r["name"]), escape(r["source"]), avail, r["kv_cache_kind"], escape(feats),
                      " ".join(DTYPE_ABBREV.get(d, d) for d in r["dtypes"]),
                      compact_sizes(r["head_sizes"]), compact_sizes(r["kernel_block_sizes"]), r["plugin_api_version"])
    console.print(table)
    for line in why_not:  # reasons under the table, so its columns stay narrow
        console.print(line, markup=False, highlight=False)
    probs = _problems(registry)
    if probs["faults"]:
        ft = Table(title="plugin problems (skipped)")
        for col in ("plugin", "entry point", "distribution", "backend", "reason"):
            ft.add_column(col, overflow="fold")
        for f in probs["faults"]:
            reason = f["reason"] + (f" (raised at {f['location']})" if f["location"] else "")
            ft.add_row(escape(f["plugin"]), escape(f["entry_point"] or "(built-in)"),
                       escape(f["distribution"] or "(built-in)"), escape(f["backend"] or ""), escape(reason))
        console.print(ft)
        if show_traceback:
            for f in probs["faults"]:
                if f["traceback"]:
                    console.print(f"\ntraceback of plugin {f['plugin']}'s fault:\n{f['traceback'].rstrip()}",
                                  markup=False, highlight=False, soft_wrap=True)
        elif any(f["traceback"] for f in probs["faults"]):
            console.print("(attnplug backends --traceback prints the whole tracebacks)", markup=False)
    for s in probs["skipped"]:
        console.print(f"skipped plugin {s['plugin']} ({s['distribution']}): {s['reason']}", markup=False)
    for note in probs["notes"]:
        console.print(f"note: {note}", markup=False)


def explain(registry, args) -> tuple[dict[str, Any], int]:
    """Selection for every cache group of ``args.model``; returns (JSON-able report, status)."""
    import torch

    from attnplug.runner.commands.model_layers import model_layer_groups
    from attnplug.plugins.selection import BackendSelector, describe_layer, rejection_reasons

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    what, groups = model_layer_groups(args.model, dtype=dtype, device=device, block_size=args.block_size)
    selector = BackendSelector(args.backend, registry=registry)
    report: dict[str, Any] = {"model": what, "device": device, "groups": []}
    status = 0
    for g, group in enumerate(groups):
        item: dict[str, Any] = {"group": g, "kind": group.kind, "num_layers": len(group.layer_names),
                                "layers": list(group.layer_names), "layer": describe_layer(group.layer_cfg)}
        try:
            res = selector.select(group.layer_cfg, group.kind)
        except BackendUnsupportedError as exc:
            status = 1
            item.update(chosen=None, error=str(exc), rejections=[{"backend": exc.backend_name, "reasons": exc.reasons}])
        else:
            item.update(chosen=res.name, source=res.source, origin=res.origin,
                        rejections=[{"backend": r.backend, "reasons": list(r.reasons)} for r in res.rejections])
        considered = {item.get("chosen")} | {r["backend"] for r in item["rejections"]}
        item["others"] = [{"backend": name, "reasons": rejection_reasons(registry.get(name), group.layer_cfg,
                                                                          group.kind)}
                          for name in registry.names() if name not in considered]
        report["groups"].append(item)
    return report, status


def print_explain(report: dict[str, Any]) -> None:
    """Print an :func:`explain` report; every text that comes from the model, the
    configuration or a backend is escaped, so only our own markup is rendered."""
    from rich.markup import escape as e

    console = _console()
    console.print(f"[bold]model[/bold] {e(report['model'])} on {e(report['device'])}", highlight=False)
    for item in report["groups"]:
        layers, n = item["layers"], item["num_layers"]
        span = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"
        console.print(f"\n[bold]cache group {item['group']}[/bold] ({e(item['kind'])}, "
                      f"{n} layer{'' if n == 1 else 's'}: {e(span)})\n  layer: {e(item['layer'])}", highlight=False)
        if item["chosen"] is None:
            console.print(f"  [red]no backend[/red]: {e(item['error'])}", highlight=False)
            continue
        console.print(f"  chosen: [green]{e(item['chosen'])}[/green] ({e(item['origin'])})", highlight=False)
        for r in item["rejections"]:
            console.print(f"  rejected {e(r['backend'])}: " + e("; ".join(r["reasons"])), highlight=False)
        for r in item.get("others", []):
            verdict = ("could also serve" if not r["reasons"] else "cannot serve: " + "; ".join(r["reasons"]))
            console.print(f"  not tried {e(r['backend'])}: {e(verdict)}", highlight=False)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from attnplug.plugins.discovery import get_registry

    registry = get_registry()
    if args.explain:
        if not args.model:
            print("attnplug backends: --explain needs --model (e.g. --model preset)", file=sys.stderr)
            return 2
        try:
            report, status = explain(registry, args)
        except AttnplugError as exc:
            print(f"attnplug backends: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_explain(report)
        return status
    if args.matrix:
        from attnplug.runner.commands.feature_matrix import builtin_capabilities, feature_matrix_markdown

        sys.stdout.write(feature_matrix_markdown(builtin_capabilities(registry)))
        return 0
    if args.json:
        print(json.dumps({"backends": backend_rows(registry), **_problems(registry)}, indent=2))
    else:
        print_backends(registry, show_traceback=args.traceback)
    if args.strict and registry.faults:
        print(f"attnplug backends: --strict: {len(registry.faults)} plugin fault(s)", file=sys.stderr)
        return EXIT_PLUGIN_FAULT
    return 0
