"""``runner/bench_timing.time_gpu``'s protocol, with CUDA's calls replaced by recorders (the
GPU test ``tests/gpu/test_bench_gpu.py`` checks the timings themselves): per timed
call, cold L2, then a lead kernel long enough to cover the host's queueing, then the
events around the call alone."""

from __future__ import annotations

import time

import pytest
import torch

from attnplug.runner.commands.bench import timing as bt


class _Recorder:
    def __init__(self, monkeypatch, elapsed_ms: float = 0.25, sleep_calibration_ms: float = 5.0):
        self.log: list = []
        rec = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing

            def record(self):
                rec.log.append(("record", id(self)))

            def synchronize(self):
                rec.log.append(("event_sync",))

            def elapsed_time(self, end):
                calibrating = any(e[0] == "sleep" and e[1] == 10_000_000 for e in rec.log[-4:])
                return sleep_calibration_ms if calibrating else elapsed_ms

        class Flush:
            def zero_(self):
                rec.log.append(("flush",))

        monkeypatch.setattr(bt.torch.cuda, "Event", Event)
        monkeypatch.setattr(bt.torch.cuda, "synchronize", lambda: rec.log.append(("sync",)))
        monkeypatch.setattr(bt.torch.cuda, "_sleep", lambda cycles: rec.log.append(("sleep", cycles)))
        monkeypatch.setattr(bt.torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(bt, "_flush_buffer", lambda: Flush())
        monkeypatch.setattr(bt, "_cycles_per_ms", {})


def test_each_timed_call_runs_cold_behind_a_lead_kernel(monkeypatch):
    rec = _Recorder(monkeypatch)
    calls = []

    def fn():
        calls.append(len(rec.log))
        rec.log.append(("fn",))
        time.sleep(0.05 if len(calls) == 1 else 0.002 if len(calls) == 2 else 0.0005)  # compile, warm, timed

    timing = bt.time_gpu(fn, iters=3, warmup=2)
    assert len(calls) == 2 + 3 and timing.samples_ms == (0.25, 0.25, 0.25) and timing.median_ms == 0.25
    assert bt._cycles_per_ms == {0: 2_000_000.0}, "10M cycles took 5 ms"
    assert 3 * 2.0 <= timing.lead_ms < 3 * 50, "sized from the warm-up after the first (compiling) call"
    assert not timing.host_bound and 0.5 <= timing.launch_ms < timing.lead_ms, timing
    timed = rec.log[calls[2] - 4:]  # the first timed call onwards
    lead = ("sleep", int(timing.lead_ms * 2_000_000))
    for i in range(3):
        step = timed[i * 7:(i + 1) * 7]
        assert [e[0] for e in step] == ["sync", "flush", "sleep", "record", "fn", "record", "event_sync"], step
        assert step[2] == lead and step[3][1] != step[5][1], "start and end are two events"


def test_host_work_beyond_the_lead_is_reported(monkeypatch):
    _Recorder(monkeypatch)
    state = {"n": 0}

    def fn():  # fast in warm-up, then far slower than the lead (as a call that syncs inside is)
        state["n"] += 1
        if state["n"] > 1:
            time.sleep(0.02)

    timing = bt.time_gpu(fn, iters=2, warmup=1)
    assert timing.lead_ms < 20 and timing.host_bound, timing


def test_no_flush_and_bad_iters(monkeypatch):
    rec = _Recorder(monkeypatch)
    bt.time_gpu(lambda: None, iters=1, warmup=0, flush_l2=False)
    assert ("flush",) not in rec.log and sum(e[0] == "sleep" for e in rec.log) == 1 + 3 + 1  # load, calibrate, lead
    with pytest.raises(ValueError, match="iters must be >= 1"):
        bt.time_gpu(lambda: None, iters=0)


def test_lead_is_capped(monkeypatch):
    _Recorder(monkeypatch)
    monkeypatch.setattr(bt, "MAX_LEAD_MS", 1.0)
    timing = bt.time_gpu(lambda: time.sleep(0.001), iters=1, warmup=1)
    assert timing.lead_ms == 1.0


def test_the_pinned_torch_has_the_lead_kernel():
    assert callable(torch.cuda._sleep), "time_gpu's lead kernel is torch.cuda._sleep (private, stable since torch 1.x)"
