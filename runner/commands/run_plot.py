"""``attnplug run --plot OUT.png``: three panels over the run's steps — the step's stage
times stacked (update / prepare / build / forward / sample, from ``ModelRunner.timings_ns``),
the tokens it scheduled, and the KV blocks (Mamba: state slots) in use per cache group — and
a fourth over wall-clock time: each request's TTFT at its arrival and each inter-token
latency at the time its chunk became visible (``StepRecord.latency``, set by
``replay.measure``), on a log scale.

matplotlib is optional (``pip install 'attnplug[plot]'``): :func:`missing_matplotlib` says
so in one line before the run starts, as :func:`plot_path_problem` does for a file name that
is not ``.png`` or a folder that is missing or not writable; nothing else here imports
matplotlib until :func:`save_plot`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Sequence

from attnplug.cache_groups.kinds import GroupKind
from attnplug.runner.execute.model_runner import STAGES

STAGE_LABELS = {"update_states": "update", "prepare_inputs": "prepare", "metadata_build": "build",
                "forward": "forward", "sample": "sample"}
"""Legend names of :data:`~attnplug.runner.execute.model_runner.STAGES`."""


def missing_matplotlib() -> str | None:
    """The one-line error when matplotlib cannot be imported, else ``None``."""
    if importlib.util.find_spec("matplotlib") is None:
        return "attnplug run: --plot needs matplotlib: pip install 'attnplug[plot]' (or pip install matplotlib)"
    return None


def plot_path_problem(path: str) -> str | None:
    """The one-line error when ``--plot path`` cannot be written (checked before the run),
    else ``None``: the file must end in ``.png`` (the format :func:`save_plot` writes), and
    its folder must exist and be writable."""
    import os

    from attnplug.runner.commands.limits import clip

    if os.path.isdir(path):
        return f"attnplug run: --plot {clip(path)} is a folder; name a file in it, e.g. {os.path.join(path, 'run.png')}"
    if not path.lower().endswith(".png"):
        return f"attnplug run: --plot {clip(path)}: the plot is a PNG image; name the file OUT.png"
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"attnplug run: --plot {clip(path)}: no such folder {clip(folder)}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"attnplug run: --plot {clip(path)}: the folder {clip(folder)} is not writable"
    return None


@dataclass
class StepRecord:
    """Per engine step: microseconds per stage, tokens scheduled, blocks in use per group."""

    stage_us: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    tokens: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    latency: list[tuple[float, float, list[float], list[float]]] = field(default_factory=list)
    """Per measured request: ``(arrival_s, ttft_s, [time_s of each later chunk], [its ITL, s])``,
    times counted from the start of the measured run."""


class StepRecorder:
    """Call after every engine step (``LLMEngine.run(on_step=...)``): what the step added to
    the runner's stage timings (all of a stage's entries since the last call, summed: a step
    that schedules nothing times only ``update_states``), the tokens it scheduled and the
    blocks its groups hold."""

    def __init__(self, engine: Any):
        self.engine, self.record = engine, StepRecord()
        self._seen = {s: len(v) for s, v in engine.runner.timings_ns.items()}
        self._tokens = engine.stats.num_scheduled_tokens

    def __call__(self, finished: Sequence[str] = ()) -> None:
        timings, rec = self.engine.runner.timings_ns, self.record
        for s in STAGES:
            new = timings[s][self._seen[s]:]
            self._seen[s] = len(timings[s])
            rec.stage_us[s].append(sum(new) / 1e3)
        total = self.engine.stats.num_scheduled_tokens
        rec.tokens.append(total - self._tokens)
        self._tokens = total
        rec.blocks.append(list(self.engine.scheduler.kv_cache_manager.num_used_blocks_per_group))


def save_plot(record: StepRecord, path: str, group_labels: Sequence[str], title: str = "attnplug run") -> None:
    """Draw ``record`` into the PNG ``path`` (matplotlib's Agg backend; ``OSError`` passes through)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(record.tokens) + 1))
    fig, (ax_t, ax_n, ax_b, ax_l) = plt.subplots(4, 1, figsize=(10, 11), constrained_layout=True,
                                                 gridspec_kw={"height_ratios": [1, 1, 1, 1.2]})
    for ax in (ax_t, ax_n):
        ax.sharex(ax_b)
    try:
        bottom = [0.0] * len(steps)
        for s in STAGES:
            ms = [u / 1e3 for u in record.stage_us[s]]
            ax_t.bar(steps, ms, bottom=bottom, width=1.0, label=STAGE_LABELS[s], linewidth=0)
            bottom = [b + m for b, m in zip(bottom, ms)]
        ax_t.set_ylabel("stage time per step (ms)")
        ax_t.legend(loc="upper right", ncol=len(STAGES), fontsize="small")
        ax_t.set_title(title)
        ax_n.plot(steps, record.tokens, drawstyle="steps-mid", color="#333")
        ax_n.set_ylabel("tokens scheduled")
        for g, label in enumerate(group_labels):
            ax_b.plot(steps, [b[g] for b in record.blocks], drawstyle="steps-mid", label=label)
        ax_b.set_ylabel("KV blocks in use")
        ax_b.set_xlabel("step")
        ax_b.legend(loc="upper right", fontsize="small")
        for ax in (ax_t, ax_n, ax_b):
            ax.grid(axis="y", alpha=0.3)
            ax.set_ylim(bottom=0)
        _latency_panel(ax_l, record.latency)
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)


def _latency_panel(ax, latency) -> None:
    """TTFT (at arrival) and ITL (at chunk time) in ms against seconds since the run started."""
    ttft_x = [a for a, _, _, _ in latency]
    ttft_y = [t * 1e3 for _, t, _, _ in latency]
    itl_x = [x for _, _, xs, _ in latency for x in xs]
    itl_y = [g * 1e3 for _, _, _, gs in latency for g in gs]
    ax.scatter(itl_x, [max(y, 1e-3) for y in itl_y], s=4, alpha=0.35, color="#1f77b4", label="ITL (at the chunk)")
    ax.scatter(ttft_x, [max(y, 1e-3) for y in ttft_y], s=14, color="#d62728", label="TTFT (at arrival)")
    if ttft_y or itl_y:
        ax.set_yscale("log")
        ax.legend(loc="upper right", fontsize="small")
    ax.set_xlabel("seconds since the measured run started")
    ax.set_ylabel("latency (ms)")
    ax.grid(alpha=0.3)


def group_labels(summary: dict) -> list[str]:
    """``g0 full_attention (pool 511)``-style names of the run's cache groups (``--json``'s
    ``cache_groups``; Mamba groups count state slots)."""
    out = []
    for g, grp in enumerate(summary["cache_groups"]):
        window = f" W={grp['sliding_window']}" if grp.get("sliding_window") else ""
        unit = "state slots" if grp["kind"] == GroupKind.MAMBA else "blocks"
        out.append(f"g{g} {grp['kind']}{window} ({grp['capacity']} {unit})")
    return out
