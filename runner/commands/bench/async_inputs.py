"""``attnplug bench step``'s async table: ``prepare_inputs`` when the previous step's tokens
are still on the device (asynchronous scheduling, ``runner/step/placeholders.py``).

Per workload, median µs of ``prepare_inputs`` (with the common metadata) in the
synchronous protocol (the tokens were appended on the host: ``append_output_tokens``)
and in the asynchronous one (placeholders appended, ``prepare_inputs(prev_token_ids=...)``
patches ``input_ids`` from the device tensor; the tokens are filled in afterwards,
untimed there), side by side in one process, and how many steps took the slice copy (rows
kept their order) or the scatter (condense moved rows). ``update_states`` is the same in
both. Stage 8 is timed apart: ``append_output_tokens`` in the synchronous protocol,
``fill_output_tokens`` then ``append_placeholders`` in the asynchronous one (the sampled
tokens already a list: the ``.tolist()`` is the caller's).
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch

from attnplug.runner.commands.bench.workloads import Workload, steady_decode
from attnplug.runner.step.compiler import StepCompiler


def time_prepare(workload: Workload, steps: int, asynchronous: bool) -> dict:
    """Median µs per step of ``prepare_inputs`` (+ common metadata) over ``steps`` steps
    (``median_us``), and of stage 8 (``stage8_us``)."""
    cfg = dict(workload.config)
    sc = StepCompiler(cfg.pop("block_sizes"), validate=False, **cfg)
    prev = None
    times, stage8 = [], []
    gc.collect()
    gc.disable()
    try:
        for i, so in enumerate(workload.steps[:workload.num_warmup + steps]):
            sc.update_states(so)
            t0 = time.perf_counter_ns()
            inputs = sc.prepare_inputs(so, prev_token_ids=None if prev is None else prev[1])
            t1 = time.perf_counter_ns()
            keep = np.flatnonzero(~inputs.discard)
            sampled = torch.ones(keep.shape[0], dtype=torch.int64)
            filled = None if prev is None else prev[1].tolist()
            t2 = time.perf_counter_ns()
            if asynchronous:
                if filled is not None:
                    sc.fill_output_tokens(prev[0], filled)
                prev = (sc.append_placeholders(keep), sampled)
            else:
                sc.append_output_tokens(keep, sampled.numpy())
            t3 = time.perf_counter_ns()
            if i >= workload.num_warmup:
                times.append(t1 - t0)
                stage8.append(t3 - t2)
    finally:
        gc.enable()
    return {"median_us": float(np.median(times)) / 1e3 if times else 0.0,
            "stage8_us": float(np.median(stage8)) / 1e3 if stage8 else 0.0, **sc.patch_counts}


def run_async(sizes: list[int], steps: int, repeat: int) -> list[dict]:
    """One row per workload: steady decode with arrivals (rows move) and without (they
    do not) at each size; best of ``repeat`` per protocol."""
    rows = []
    for n in sizes:
        for arrivals in (True, False):
            w = steady_decode(n, steps, arrivals=arrivals)
            runs = [(time_prepare(w, steps, False), time_prepare(w, steps, True)) for _ in range(max(1, repeat))]
            sync = min((r[0] for r in runs), key=lambda r: r["median_us"])  # interleaved: same weather
            asy = min((r[1] for r in runs), key=lambda r: r["median_us"])
            s8_sync = min(r[0]["stage8_us"] for r in runs)
            s8_async = min(r[1]["stage8_us"] for r in runs)
            rows.append(dict(workload=w.name, sync_us=sync["median_us"], async_us=asy["median_us"],
                             ratio=asy["median_us"] / sync["median_us"] if sync["median_us"] else None,
                             slice_steps=asy["slice"], scatter_steps=asy["scatter"],
                             stage8_sync_us=s8_sync, stage8_async_us=s8_async))
    return rows


def render_async(rows: list[dict], markdown: bool) -> str:
    """The table (markdown, or plain aligned text)."""
    head = ["workload", "prepare µs sync", "prepare µs async", "async / sync", "slice steps", "scatter steps",
            "stage 8 µs sync", "stage 8 µs async"]
    body = [[r["workload"], f"{r['sync_us']:.1f}", f"{r['async_us']:.1f}",
             "-" if r["ratio"] is None else f"{r['ratio']:.2f}", str(r["slice_steps"]), str(r["scatter_steps"]),
             f"{r['stage8_sync_us']:.1f}", f"{r['stage8_async_us']:.1f}"]
            for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *body])
