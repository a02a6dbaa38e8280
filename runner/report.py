"""The table ``attnplug run`` prints at the end (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def print_run_table(summary: dict[str, Any], console: Console | None = None) -> None:
    """Render a ``setup.EngineSetup.summary`` dict as two tables (run, cache groups)."""
    console = console or Console()
    t = Table(title="attnplug run", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("requests", str(summary["requests"]))
    t.add_row("steps", str(summary["steps"]))
    t.add_row("prompt tokens", str(summary["prompt_tokens"]))
    t.add_row("generated tokens", str(summary["generated_tokens"]))
    t.add_row("tokens/s (scheduled)", f"{summary['tokens_per_s']:.1f}")
    t.add_row("generated tokens/s", f"{summary['generated_tokens_per_s']:.1f}")
    t.add_row("preemptions", str(summary["preemptions"]))
    for stage, us in summary["median_us_per_step"].items():
        t.add_row(f"median µs/step {stage}", f"{us:.1f}")
    t.add_row("metadata builds / reuses per step",
              f"{summary['metadata_builds_per_step']} / {summary['metadata_reuses_per_step']}")
    inv = summary.get("batch_invariance")
    if inv:
        t.add_row("batch invariance", f"{inv['identical']}/{inv['checked']} identical")
    console.print(t)

    g = Table(title="cache groups", show_header=True)
    for col in ("group", "kind", "layers", "block size", "backend", "peak KV blocks"):
        g.add_column(col)
    for i, (grp, peak) in enumerate(zip(summary["cache_groups"], summary["peak_kv_blocks_per_group"])):
        g.add_row(str(i), grp["kind"], str(grp["layers"]), str(grp["block_size"]), grp["backend"],
                  f"{peak} / {summary['num_blocks_per_group'] - 1}")
    console.print(g)
