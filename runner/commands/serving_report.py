"""The serving tables ``attnplug run`` prints after the run table: latencies (TTFT, TPOT,
ITL, E2EL: mean, median, std and percentiles, ms), throughput and goodput, the arrivals,
peak RSS, and with ``--repeat`` the min / median / max of each figure over the runs."""

from __future__ import annotations

import re
from typing import Any

from rich.table import Table

from attnplug.runner.commands.serving_metrics import LATENCY_METRICS

NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def _percentiles(summary: dict[str, Any]) -> list[str]:
    """The ``p..`` words present for TTFT, in ascending order (``["p90", "p99"]``)."""
    words = [m.group(1) for k in summary if (m := re.fullmatch(r"(p[0-9.]+)_ttft_ms", k))]
    return sorted(words, key=lambda w: float(w[1:]))


def arrivals_text(a: dict[str, Any]) -> str:
    """``poisson, 2 req/s`` / ``trace timestamps x 0.5`` / ``all at t=0``."""
    mode = a.get("mode", "all at t=0")
    if mode in ("poisson", "gamma", "constant"):
        shape = "" if mode == "poisson" else f", burstiness {a['burstiness']:g}"
        return f"{mode}, {a['request_rate']:g} req/s{shape}"
    if mode == "trace timestamps":
        return f"trace timestamps x {a.get('time_scale', 1.0):g}"
    return mode


def latency_table(summary: dict[str, Any]) -> Table:
    pcts = _percentiles(summary)
    n = summary.get("torch_threads")
    threads = "" if n is None else f"; {n} torch thread{'s' if n != 1 else ''}"
    t = Table(title=f"latency, ms (vllm bench serve's definitions{threads})", show_header=True)
    for col in ("metric", "mean", "median", "std", *pcts):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for m in LATENCY_METRICS:
        keys = [f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", *(f"{p}_{m}_ms" for p in pcts)]
        t.add_row(NAMES[m], *(f"{summary[k]:.2f}" for k in keys))
    return t


def throughput_table(summary: dict[str, Any]) -> Table:
    t = Table(title="serving", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("arrivals", arrivals_text(summary.get("arrivals") or {}))
    t.add_row("warm-up requests (excluded)", str(summary.get("warmup_requests", 0)))
    t.add_row("completed / failed requests", f"{summary['completed']} / {summary['failed']}")
    t.add_row("duration (s)", f"{summary['duration']:.3f}")
    t.add_row("request throughput (req/s)", f"{summary['request_throughput']:.2f}")
    if summary.get("request_goodput") is not None:
        t.add_row("request goodput (req/s)", f"{summary['request_goodput']:.2f}")
    t.add_row("output token throughput (tok/s)", f"{summary['output_throughput']:.1f}")
    t.add_row("total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}")
    if "peak_rss_bytes" in summary:
        t.add_row("peak RSS (process)", f"{summary['peak_rss_bytes'] / 2**20:.0f} MiB")
    return t


def repeats_table(summary: dict[str, Any]) -> Table | None:
    rep = summary.get("repeats") or {}
    if rep.get("runs", 1) < 2:
        return None
    t = Table(title=f"{rep['runs']} runs (figures above: run {rep['median_run']}, the median by duration)",
              show_header=True)
    for col in ("figure", "min", "median", "max"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    for key, v in rep["figures"].items():
        t.add_row(key, f"{v['min']:.2f}", f"{v['median']:.2f}", f"{v['max']:.2f}")
    t.add_row("outputs identical", "", "yes" if rep["outputs_identical"] else "NO", "")
    return t


def print_serving_tables(summary: dict[str, Any], console) -> None:
    """Print the tables of a summary that has serving figures (nothing otherwise)."""
    if "mean_ttft_ms" not in summary:
        return
    console.print(throughput_table(summary))
    console.print(latency_table(summary))
    rep = repeats_table(summary)
    if rep is not None:
        console.print(rep)
