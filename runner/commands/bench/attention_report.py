"""The table and JSON of ``attnplug bench attention`` (``runner/commands/bench/attention.py``).

The markdown is written piece by piece — header, each workload's rows as soon as they are
final, then the footer — and the JSON is rewritten after every workload, so a run cut off
by a timeout still leaves every finished workload behind (``tests/gpu/run_all.sh`` records
both). :class:`Result` (one row) and :class:`DevicePeaks` are defined here, the rows and
peaks this module renders; the command fills them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from attnplug.runner.commands.traces import BUNDLED_ATTRIBUTION, BUNDLED_TRACES


@dataclass
class Result:
    """One (workload, backend) row: its timing, rates, fractions of the device's peaks,
    difference from ``torch_native`` and note (``None`` where not measured)."""

    workload: str
    backend: str
    ms: float | None = None
    launch_ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    frac_matmul: float | None = None
    frac_copy: float | None = None
    max_abs_diff: float | None = None
    vs_flash: float | None = None
    flash_baseline: str | None = None
    note: str = ""


@dataclass
class DevicePeaks:
    """The device's name and measured copy bandwidth (GB/s) and matmul rate (TFLOP/s)."""

    name: str
    copy_gbps: float
    matmul_tflops: float
    extra: dict = field(default_factory=dict)


COLUMNS = ("workload", "backend", "ms", "launch ms", "TFLOP/s", "GB/s", "% matmul", "% copy BW", "vs flash",
           "max abs diff", "note")


def _fmt(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def source_line(args) -> str:
    """Where the workloads' lengths come from, with the attribution a bundled trace needs."""
    if args.trace in BUNDLED_TRACES:
        return f"Request lengths: bundled trace `{args.trace}` — {BUNDLED_ATTRIBUTION}."
    return f"Request lengths: trace file `{args.trace}`."


def render_header(peaks: DevicePeaks, args) -> list[str]:
    """The device's measured peaks, the layer, the timing method and the table's head."""
    return [f"Device: {peaks.name}; measured copy bandwidth {peaks.copy_gbps:,.0f} GB/s, {args.dtype} matmul "
            f"{peaks.matmul_tflops:,.0f} TFLOP/s. Layer: {args.num_heads} heads / {args.num_kv_heads} KV heads x "
            f"{args.head_size}, {args.dtype}, block {args.block_size}. ms: median GPU time of {args.iters} calls "
            f"(cold L2, launch overhead excluded: runner/commands/bench/timing.py); launch ms: host time to queue "
            f"one call (torch {torch.__version__}, torch threads {torch.get_num_threads()}).",
            source_line(args), "",
            "| " + " | ".join(COLUMNS) + " |",
            "|" + "---|" * len(COLUMNS)]


def render_rows(results: list[Result]) -> list[str]:
    """One table row per result."""
    lines = []
    for r in results:
        cells = (r.workload, r.backend, _fmt(r.ms, ".3f"), _fmt(r.launch_ms, ".3f"), _fmt(r.tflops, ".1f"),
                 _fmt(r.gbps, ",.0f"), _fmt(r.frac_matmul and 100 * r.frac_matmul, ".1f"),
                 _fmt(r.frac_copy and 100 * r.frac_copy, ".1f"), _fmt(r.vs_flash, ".2f"),
                 _fmt(r.max_abs_diff, ".2e"), r.note)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_footer(results: list[Result]) -> list[str]:
    """What "vs flash" divides by (nothing when no row had a baseline)."""
    baselines = sorted({r.flash_baseline for r in results if r.flash_baseline})
    if not baselines:
        return []
    return ["", "vs flash: throughput relative to " + " / ".join(f"`{b}`" for b in baselines) +
            " on the same batch (flash_attn where it ran, else PyTorch's bundled FlashAttention-2 kernel on "
            "contiguous K/V, which skips the paging and the K/V write that a backend's forward does)."]


def render(peaks: DevicePeaks, results: list[Result], args) -> str:
    """The whole markdown table (what ``--markdown`` prints)."""
    return "\n".join(render_header(peaks, args) + render_rows(results) + render_footer(results))


def write_json(path: str, peaks: DevicePeaks, results: list[Result], args, *, complete: bool) -> None:
    """Device peaks, arguments, trace attribution and results; ``complete`` is False while
    workloads are still to come (the file is rewritten after each)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"complete": complete, "device": asdict(peaks), "torch": torch.__version__,
                   "torch_threads": torch.get_num_threads(), "args": dict(vars(args)),
                   "source": source_line(args), "results": [asdict(r) for r in results]}, f, indent=1)


__all__ = ["COLUMNS", "DevicePeaks", "Result", "render", "render_footer", "render_header", "render_rows", "source_line", "write_json"]
