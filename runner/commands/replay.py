"""``attnplug run``'s measured runs: warm-up requests, then the trace's requests admitted at
their arrival times (``ServingPlan``), then the serving figures (``serving_metrics.py``);
``--repeat N`` does it N times on fresh engines over the same model.

Every figure of the run (the engine's counters, stage timings, the serving metrics)
excludes the warm-up requests: they run to completion first, then ``LLMEngine.reset_stats``
clears the counters and the measured run's clock starts.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from attnplug.runner.commands.run_plot import StepRecord, StepRecorder
from attnplug.runner.commands.serving_flags import ServingPlan
from attnplug.runner.commands.serving_metrics import LATENCY_METRICS, percentile_key, serving_metrics
from attnplug.runner.serve.admission import check_new_request

THROUGHPUT_KEYS = ("duration", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput")


@dataclass
class MeasuredRun:
    """One measured run.

    Attributes:
        results: ``{req_id: RequestResult}`` of the measured requests (warm-up excluded).
        wall_s: from the start of the measured run until the engine stopped, seconds.
        summary: ``EngineSetup.summary`` plus the serving figures (vLLM's keys) and
            ``arrivals``.
        record: per-step records and latency series for ``--plot`` (else ``None``).
    """

    results: dict
    wall_s: float
    summary: dict[str, Any]
    record: StepRecord | None = None


def validate(setup, plan: ServingPlan) -> None:
    """Check every warm-up and measured request as ``Scheduler.add_request`` will, before
    anything runs (nothing changes).

    Raises:
        InvalidRequestError: the first request the scheduler would refuse.
    """
    sched = setup.engine.scheduler
    for rid, prompt, sp in [*plan.warmup, *((r, p, setup.sampling_params[r]) for r, p in setup.prompts.items())]:
        check_new_request(sched.config, sched.kv_cache_manager, sched.requests, rid, prompt, sp)


def warm_up(engine, requests) -> None:
    """Run ``requests`` (``(req_id, prompt, SamplingParams)``) to completion, forget them,
    and reset the engine's figures."""
    if not requests:
        return
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    engine.run()
    for rid, _, _ in requests:
        engine.results.pop(rid, None)
        engine.timings.pop(rid, None)
    engine.reset_stats()


def measure(setup, plan: ServingPlan, *, record: bool = False,
            on_step: Callable[[list[str]], None] | None = None) -> MeasuredRun:
    """Warm up, then replay ``setup.prompts`` at ``plan.arrival_s`` on ``setup.engine``."""
    engine = setup.engine
    warm_up(engine, plan.warmup)
    recorder = StepRecorder(engine) if record else None

    def step_done(finished: list[str]) -> None:
        if recorder is not None:
            recorder(finished)
        if on_step is not None:
            on_step(finished)

    t0 = engine.clock.now()
    for rid, prompt in setup.prompts.items():
        engine.add_request(rid, prompt, setup.sampling_params[rid], arrival_time=t0 + plan.arrival_s[rid])
    results = engine.run(on_step=step_done)
    wall = engine.clock.now() - t0
    measured = {rid: results[rid] for rid in setup.prompts if rid in results}
    timings = [engine.timings[rid] for rid in measured]
    ends = [t.chunk_times[-1] for t in timings if t.chunk_times]
    duration = (max(ends) - t0) if ends and max(ends) > t0 else max(wall, 1e-9)
    serving = serving_metrics(timings, [len(r.prompt_token_ids) for r in measured.values()],
                              [len(r.output_token_ids) for r in measured.values()], duration,
                              plan.goodput, plan.percentiles)
    summary = setup.summary(measured, wall)
    summary.update(serving, arrivals=plan.arrivals, request_rate=plan.arrivals["request_rate"],
                   burstiness=plan.arrivals["burstiness"], warmup_requests=len(plan.warmup))
    if recorder is not None:
        recorder.record.latency = [(t.arrival_time - t0, t.ttft, [c - t0 for c in t.chunk_times[1:]], t.itl)
                                   for t in timings if t.chunk_times]
    return MeasuredRun(measured, wall, summary, recorder.record if recorder else None)


def repeated_keys(summary: dict[str, Any], percentiles) -> list[str]:
    """The figures ``--repeat`` gives min / median / max of."""
    keys = [k for k in THROUGHPUT_KEYS if summary.get(k) is not None]
    for m in LATENCY_METRICS:
        keys += [f"mean_{m}_ms", f"median_{m}_ms"] + [percentile_key(p, m) for p in percentiles]
    return keys


def combine(runs: list[MeasuredRun], percentiles) -> tuple[int, dict[str, Any]]:
    """``(index of the median run by duration, its summary plus "repeats")``.

    ``repeats``: ``runs``; ``median_run`` (1-based); ``outputs_identical`` (every run's
    ``outputs_digest`` equal); and per figure ``{"min", "median", "max"}`` over the runs.
    """
    order = sorted(range(len(runs)), key=lambda i: runs[i].summary["duration"])
    chosen = order[(len(runs) - 1) // 2]
    summary = dict(runs[chosen].summary)
    spread = {}
    for key in repeated_keys(summary, percentiles):
        values = np.asarray([r.summary[key] for r in runs], dtype=np.float64)
        spread[key] = {"min": float(values.min()), "median": float(np.median(values)), "max": float(values.max())}
    summary["repeats"] = {"runs": len(runs), "median_run": chosen + 1,
                          "outputs_identical": len({r.summary["outputs_digest"] for r in runs}) == 1,
                          "figures": spread}
    summary["peak_rss_bytes"] = peak_rss_bytes()
    return chosen, summary


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (``getrusage``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
