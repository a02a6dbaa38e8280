"""``attnplug run --plot OUT.png``: what each step records, the PNG, and the one-line error
when matplotlib is missing."""

from __future__ import annotations

import json

import pytest

from attnplug.runner.commands import replay, run as run_mod, run_plot
from attnplug.runner.execute.model_runner import STAGES

SMALL = ["--model", "tiny-hybrid", "--num-requests", "6", "--max-model-len", "256", "--invariance-requests", "0", "--json"]


def test_plot_records_every_step_and_writes_a_png(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    seen = {}

    def keep(record, path, labels, title="attnplug run"):
        seen.update(record=record, labels=labels)
        run_plot.save_plot(record, path, labels, title)

    monkeypatch.setattr(run_mod, "save_plot", keep)
    real_recorder = replay.StepRecorder
    monkeypatch.setattr(replay, "StepRecorder", lambda engine: seen.setdefault("recorder", real_recorder(engine)))
    png = tmp_path / "run.png"
    assert run_mod.main(SMALL + ["--plot", str(png)]) == 0
    summary = json.loads(capsys.readouterr().out)
    rec, steps = seen["record"], summary["steps"]
    assert len(rec.tokens) == len(rec.blocks) == steps and sum(rec.tokens) == summary["scheduled_tokens"]
    assert all(len(rec.stage_us[s]) == steps for s in STAGES)
    assert all(sum(rec.stage_us[s]) > 0 for s in STAGES)
    # each stage entry counted once: everything the runner timed, but the closing flush
    # step's update_states (engine.run schedules once more after the last step, no tokens)
    timings = seen["recorder"].engine.runner.timings_ns
    for s in STAGES:
        ns = timings[s][:-1] if s == "update_states" else timings[s]
        assert sum(rec.stage_us[s]) == pytest.approx(sum(ns) / 1e3)
    groups = len(summary["cache_groups"])
    assert len(seen["labels"]) == groups and all(len(b) == groups for b in rec.blocks)
    for g in range(groups):
        in_use = [b[g] for b in rec.blocks]
        assert 0 < max(in_use) <= summary["peak_kv_blocks_per_group"][g]
    # the latency panel: per request its arrival and TTFT, then one (time, ITL) per later chunk
    assert len(rec.latency) == summary["requests"]
    assert sum(len(itl) for *_, itl in rec.latency) > 0
    for arrival, ttft, times, itl in rec.latency:
        assert arrival >= 0 and ttft > 0 and len(times) == len(itl) and all(g >= 0 for g in itl)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_missing_matplotlib_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    real = run_plot.importlib.util.find_spec
    monkeypatch.setattr(run_plot.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert run_mod.main(SMALL + ["--plot", str(tmp_path / "x.png")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "attnplug[plot]" in out.err
    assert not (tmp_path / "x.png").exists()
