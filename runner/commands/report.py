"""The table ``attnplug run`` prints at the end (rich)."""

from __future__ import annotations

from typing import Any

import rich.console
from rich.table import Table

from attnplug.cache_groups.kinds import GroupKind
from attnplug.runner.commands.prefix_report import prefix_caching_rows
from attnplug.runner.commands.kv_connector_setup import kv_connector_rows
from attnplug.runner.commands.serving_report import print_serving_tables


PIPE_WIDTH = 1000
"""Columns a :class:`Console` lays out in when its file is not a terminal (a file, a pipe):
wide enough that a table keeps its natural width, so no cell is wrapped or cut with "…"."""


class Console(rich.console.Console):
    """A rich console whose broken pipe is a ``BrokenPipeError`` (rich's own handler exits
    with status 1), so ``runner/commands/cli.py`` ends every subcommand the same way.

    Written to a file or a pipe (``attnplug bench step > f.txt``) it is
    :data:`PIPE_WIDTH` columns wide unless ``width`` is given: rich would otherwise lay
    tables out in 80 columns and cut numbers with "…"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if kwargs.get("width") is None and not self.is_terminal:
            self.width = PIPE_WIDTH

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError("stdout's reader went away")


def print_run_table(summary: dict[str, Any], console: Console | None = None) -> None:
    """Render a ``setup.EngineSetup.summary`` dict as two tables: the run (counts, median
    µs per stage, metadata builds / reuses per step, batch invariance: "K/N identical", or
    "not checked" when no request was re-run) and the cache groups
    (kind and window, layers, backend, cache dtype, peak KV blocks or Mamba state slots in use
    against the group's pool, the pool's bytes; with ``--kv-cache-dtype`` fp8 the run table
    says where the scales came from), then the serving tables (``serving_report.py``)."""
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
    if "async_scheduling" in summary:
        mode = "async (1 step in flight)" if summary["async_scheduling"] else "sync"
        t.add_row("scheduling", mode)
        t.add_row("steps/s", f"{summary['steps_per_s']:.1f}")
        if summary["async_scheduling"]:
            t.add_row("output waits / ms waiting", f"{summary['output_waits']} / {summary['output_wait_ms']:.1f}")
        t.add_row("torch threads", str(summary["torch_threads"]))
        t.add_row("outputs digest", summary["outputs_digest"][:16])
    for metric, value in prefix_caching_rows(summary):  # --prefix-caching (prefix_report.py)
        t.add_row(metric, value)
    for metric, value in kv_connector_rows(summary):  # --kv-connector (kv_connector_setup.py)
        t.add_row(metric, value)
    if "tokens_per_step" in summary:
        t.add_row("generated tokens / step", f"{summary['tokens_per_step']:.3f}")
    spec = summary.get("speculative")
    if spec:
        t.add_row("speculative", f"{spec['method']} k={spec['k']}")
        t.add_row("draft tokens proposed / accepted", f"{spec['draft_tokens']} / {spec['accepted_tokens']}")
        t.add_row("acceptance rate", f"{spec['acceptance_rate']:.3f}")
        t.add_row("mean accepted length", f"{spec['mean_accepted_length']:.3f}")
    for stage, us in summary["median_us_per_step"].items():
        t.add_row(f"median µs/step {stage}", f"{us:.1f}")
    t.add_row("metadata builds / reuses per step",
              f"{summary['metadata_builds_per_step']} / {summary['metadata_reuses_per_step']}")
    kvc = summary.get("kv_cache") or {}
    if kvc.get("dtype", "auto") != "auto":  # --kv-cache-dtype (kv_cache_setup.py)
        t.add_row("KV cache dtype / scales", f"{kvc['dtype']} / {kvc['scales']} ({kvc['granularity']})")
    inv = summary.get("batch_invariance")
    if inv is not None:
        checked = inv.get("checked", 0)
        t.add_row("batch invariance", f"{inv['identical']}/{checked} identical" if checked else "not checked")
    console.print(t)

    g = Table(title="cache groups", show_header=True)
    for col in ("group", "kind", "layers", "block", "backend", "KV dtype", "peak / pool"):
        g.add_column(col, no_wrap=col != "backend")  # a long backend name wraps, the figures never do
    g.add_column("B/tok", no_wrap=True)  # cache bytes per token and layer (MLA: the latent row)
    g.add_column("KV MiB", no_wrap=True)  # the group's whole cache (every layer, every block)
    for i, (grp, peak) in enumerate(zip(summary["cache_groups"], summary["peak_kv_blocks_per_group"])):
        kind = {"full_attention": "full", "sliding_window": "sliding"}.get(grp["kind"], grp["kind"])
        if grp.get("sliding_window"):
            kind += f" W={grp['sliding_window']}"
        capacity = grp.get("capacity", summary["num_blocks_per_group"] - 1)
        unit = "state slots" if grp["kind"] == GroupKind.MAMBA else "KV blocks"
        block = "-" if grp["kind"] == GroupKind.MAMBA else str(grp["block_size"])
        per_token = grp.get("bytes_per_token_per_layer")
        kv = f"{grp['kv_cache_bytes'] / 2**20:.2f}" if "kv_cache_bytes" in grp else "-"
        g.add_row(str(i), kind, str(grp["layers"]), block, grp["backend"], grp.get("kv_cache_dtype") or "-",
                  f"{peak}/{capacity} {unit}",
                  "-" if per_token is None else str(per_token), kv)
    console.print(g)
    print_serving_tables(summary, console)  # serving_report.py (TTFT / TPOT / ITL / E2EL)
    trace = summary.get("trace") or {}
    if trace.get("attribution"):
        console.print(f"Request lengths: bundled trace `{trace['source']}`, {trace['attribution']}.")
