"""``attnplug bench step``: median microseconds per step of the step compiler's stages.

Stages: ``update_states``, ``prepare_inputs`` (including slot mapping and block-table
commit) and ``common metadata`` (the per-group ``CommonAttentionMetadata``), for our
:class:`StepCompiler` with its compiled fast paths ("ours"), the same compiler on its
numpy paths only ("numpy path", ``native=False``; what runs where the extension is not
built) and the naive per-request Python implementation (:mod:`attnplug.runner.step.oracle`)
side by side, on the same recorded steps, in the same process, with one torch thread
unless ``--torch-threads`` / ``ATTNPLUG_TORCH_THREADS`` say otherwise. Each workload is
replayed ``--repeat`` times and the run with the lowest median total is reported ("best of
N", as ``timeit`` does: the machine is shared and noisy). Workloads are in
:mod:`attnplug.runner.commands.bench.workloads`. Appending the sampled tokens after each step is
not timed. The garbage collector is paused while a workload is timed (as ``timeit`` does).

Targets (issue "Foundation"): steady decode, two cache groups, update_states +
prepare_inputs ≤ 150 µs at N=256 and ≤ 400 µs at N=1024 (row "update + prepare": the
median of the per-step sum; "total" adds the metadata).

A second table (``--hybrid-steps``, :mod:`attnplug.runner.commands.bench.metadata`): a 48-layer
hybrid in 6 cache groups, the per-step time of the backends' metadata builders with
builder caching on and off, side by side.

The builders tables (``--builder-steps``, :mod:`attnplug.runner.commands.bench.builders`): µs
per ``build()`` / ``update_block_table()`` per backend at each N and on the trace, and the
full step (update + prepare + every group's builder) of the 3-group tiny-hybrid and the
6-group 48-layer hybrid. ``--json`` prints every figure as JSON instead (min / median /
max over the ``--repeat`` replays, the torch thread count and the load average at start).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import statistics
import time
from typing import Callable

import numpy as np
import torch

from attnplug.runner.commands.bench.timing import render_stage_table, timed_compile
from attnplug.runner.commands.bench.workloads import Workload, steady_decode, trace_replay
from attnplug.runner.commands.limits import OneLineParser, bounded_int
from attnplug.runner.commands import threads
from attnplug.runner.commands.traces import BUNDLED_ATTRIBUTION
from attnplug.runner.step.oracle import NaiveStepCompiler
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.packed_deltas import as_vllm_form
from attnplug.runner.step.compiler import StepCompiler

STAGES = ("update_states", "prepare_inputs", "common metadata")
TARGETS_US = {256: 150.0, 1024: 400.0}
"""Steady-decode target of update_states + prepare_inputs per N (µs): compared with the
median over steps of their per-step sum (row "update + prepare")."""


def _run(workload: Workload, steps: int, step_fn: Callable) -> dict[str, float]:
    """Replay ``num_warmup + steps`` steps; return the median µs per stage (and total)."""
    times = np.zeros((steps, len(STAGES)), dtype=np.int64)
    gc.collect()
    gc.disable()
    try:
        for i, so in enumerate(workload.steps[:workload.num_warmup + steps]):
            t = step_fn(so)
            if i >= workload.num_warmup:
                times[i - workload.num_warmup] = t
    finally:
        gc.enable()
    n = max(0, min(steps, len(workload.steps) - workload.num_warmup))
    times = times[:n] / 1e3
    out = {s: float(np.median(times[:, j])) for j, s in enumerate(STAGES)}
    out["update + prepare"] = float(np.median(times[:, 0] + times[:, 1]))
    out["total"] = float(np.median(times.sum(axis=1)))
    out["steps"] = n
    return out


def best_of(repeat: int, fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Run ``fn`` ``repeat`` times; keep the run with the lowest median total.

    The machine is shared and noisy; like ``timeit``'s "best of N", the least disturbed run
    is the best estimate of the code's own cost. Each run is a fresh replay of the workload.
    """
    runs = [fn() for _ in range(max(1, repeat))]
    return min(runs, key=lambda r: r["total"])


def time_optimized(workload: Workload, steps: int, native: bool | None = None) -> dict[str, float]:
    """Our ``StepCompiler``: compiled fast paths when built (``native=None``), or the numpy
    paths only (``native=False``)."""
    cfg = dict(workload.config)
    sc = StepCompiler(cfg.pop("block_sizes"), validate=False, native=native, **cfg)

    def step(so):
        inputs, ns = timed_compile(sc, so)
        keep = np.flatnonzero(~inputs.discard)
        sc.append_output_tokens(keep, np.ones(keep.shape[0], dtype=np.int64))
        return ns

    return _run(workload, steps, step)


def time_naive(workload: Workload, steps: int) -> dict[str, float]:
    cfg = dict(workload.config)
    bs = cfg.pop("block_sizes")
    if not isinstance(bs, list):  # a KVCacheConfig
        cfg.update(num_blocks=bs.num_blocks, group_kinds=[g.kv_cache_spec.kind for g in bs.groups])
        bs = bs.block_sizes
    nc = NaiveStepCompiler(bs, **cfg)
    clock = time.perf_counter_ns

    def step(so):
        t0 = clock()
        nc.update_states(so)
        t1 = clock()
        inputs = nc.prepare_inputs(so)
        t2 = clock()
        nc.build_common_attn_metadata(inputs)
        t3 = clock()
        keep = [rid for rid, d in zip(inputs.req_ids, inputs.discard) if not d]
        nc.append_output_tokens(keep, [1] * len(keep))
        return t1 - t0, t2 - t1, t3 - t2

    return _run(workload, steps, step)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def render(rows: list[tuple[str, dict, dict | None, dict | None, float | None]], markdown: bool) -> str:
    """The table as markdown, or printed with ``rich`` (returns "").

    Each row: ``(workload, ours, numpy_path, naive, target)``; ``numpy_path`` / ``naive``
    may be ``None`` (not run)."""
    header = ["workload", "stage", "ours µs", "numpy path µs", "naive µs", "numpy / ours", "naive / ours",
              "target µs"]
    lines = []
    for name, ours, numpy_path, naive, target in rows:
        for stage in (*STAGES, "update + prepare", "total"):
            np_ = numpy_path[stage] if numpy_path else None
            nv = naive[stage] if naive else None
            tgt = ""
            if stage == "update + prepare" and target is not None:
                tgt = f"{target:.0f} ({'met' if ours[stage] <= target else 'missed'})"
            lines.append([name if stage == STAGES[0] else "", stage, _fmt(ours[stage]), _fmt(np_), _fmt(nv),
                          f"{np_ / ours[stage]:,.1f}×" if np_ else "-", f"{nv / ours[stage]:,.1f}×" if nv else "-",
                          tgt])
    return render_stage_table("attnplug bench step — median µs per step (1 torch thread)", header, lines, markdown)


def _ours_and_numpy(args, w: Workload, steps: int) -> tuple[list[dict], list[dict] | None]:
    """``repeat`` replays of our compiler with and without the compiled paths, the two
    interleaved so that both see the same machine weather (the table shows the best). The
    numpy paths get the steps in vLLM's form, as the scheduler sends them to a runner
    without the compiled kernels (``SchedulerConfig.packed_deltas``)."""
    if not kernels_available() or args.no_numpy:
        return [time_optimized(w, steps) for _ in range(max(1, args.repeat))], None
    wv = dataclasses.replace(w, steps=[as_vllm_form(s) for s in w.steps])
    runs = [(time_optimized(w, steps), time_optimized(wv, steps, native=False)) for _ in range(max(1, args.repeat))]
    return [r[0] for r in runs], [r[1] for r in runs]


def _best(runs: list[dict] | None) -> dict | None:
    return None if runs is None else min(runs, key=lambda r: r["total"])


def _spread(runs: list[dict] | None) -> dict | None:
    """Per stage ``{"min", "median", "max"}`` over the replays."""
    if runs is None:
        return None
    keys = [k for k in runs[0] if k != "steps"]
    return {k: {"min": min(r[k] for r in runs), "median": statistics.median(r[k] for r in runs),
                "max": max(r[k] for r in runs)} for k in keys}


MAX_BATCH_SIZE = 4096
"""Largest ``--sizes`` batch: ``attnplug run --max-num-seqs``'s limit (``run.FLAG_LIMITS``)."""
MAX_STEPS = 100_000
"""Largest value of the ``--*-steps`` flags and ``--repeat``."""


def _sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated ints in ``[1, MAX_BATCH_SIZE]`` (empty: none)."""
    parse = bounded_int(1, MAX_BATCH_SIZE, what=" (a batch size)")
    return [parse(x) for x in text.split(",") if x.strip()]


def _int_at_least(low: int):
    """A bounded ``type=``: an int in ``[low, MAX_STEPS]``."""
    return bounded_int(low, MAX_STEPS)


# `attnplug bench NAME ...` for the benchmarks with their own module and flags: NAME -> (module, its main)
_SUBCOMMANDS = {
    "broadcast": "attnplug.runner.commands.bench.broadcast",  # under torchrun
    "moe": "attnplug.runner.commands.bench.moe",
    "threads": "attnplug.runner.commands.bench.threads",
    "engine": "attnplug.runner.commands.bench.engine",
    "paged-kernel": "attnplug.runner.commands.bench.paged_kernel",
    "linear": "attnplug.runner.commands.bench.linear",
    "serve": "attnplug.runner.commands.bench.serve_client",
}


def _subcommand(argv: list[str]) -> int | None:
    """Run ``argv[0]``'s own benchmark (:data:`_SUBCOMMANDS`, or ``attention``: the CPU sweep
    without CUDA or with ``--device cpu``) and return its status; ``None`` for the step bench."""
    if not argv:
        return None
    rest = list(argv[1:])
    if argv[0] in _SUBCOMMANDS:
        return importlib.import_module(_SUBCOMMANDS[argv[0]]).main(rest)
    if argv[0] == "attention":
        cpu = (not torch.cuda.is_available() or "--device=cpu" in rest
               or "cpu" in [b for a, b in zip(rest, rest[1:]) if a == "--device"])
        module = "attention_cpu" if cpu else "attention"
        return importlib.import_module(f"attnplug.runner.commands.bench.{module}").main(rest)
    return None


def _parser() -> OneLineParser:
    """The step bench's flags."""
    parser = OneLineParser(prog="attnplug bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", default="step",
                        choices=["step", "attention", "broadcast", "moe", "threads", "engine", "paged-kernel", "linear"],
                        help="the benchmark to run (default: step; `attention --help` / `moe --help` / "
                             "`threads --help` / `engine --help` / `paged-kernel --help` / `linear --help` for their options; `broadcast` runs under torchrun)")
    parser.add_argument("--steps", type=_int_at_least(1), default=300,
                        help="timed steady-decode steps per size (default 300)")
    parser.add_argument("--sizes", type=_sizes, default=[16, 64, 256, 1024],
                        help=f"steady-decode batch sizes N, comma-separated, each in [1, {MAX_BATCH_SIZE}] (empty: none)")
    parser.add_argument("--trace-steps", type=_int_at_least(0), default=300, help="trace-replay steps (0 skips it)")
    parser.add_argument("--naive-steps", type=_int_at_least(1), default=60,
                        help="timed steps for the naive implementation (it is slow; default 60)")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive implementation")
    parser.add_argument("--no-numpy", action="store_true",
                        help="skip the numpy-path column (our compiler without the compiled fast paths)")
    parser.add_argument("--prompt-arrays", action="store_true",
                        help="steady decode: send prompts as int32 numpy arrays instead of Python lists")
    parser.add_argument("--hybrid-steps", type=_int_at_least(0), default=100,
                        help="hybrid metadata row (48 layers, 6 groups): timed steps (0 skips it)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table instead of rich")
    parser.add_argument("--builder-steps", type=_int_at_least(0), default=200,
                        help="builders tables: timed steps per workload (0 skips them; default 200)")
    parser.add_argument("--no-compiler", action="store_true",
                        help="skip the step-compiler table (e.g. to run only the builders tables)")
    parser.add_argument("--async-steps", type=_int_at_least(0), default=100,
                        help="async table: prepare_inputs with the previous step's tokens on the device, "
                             "timed steps per workload (0 skips it; default 100)")
    parser.add_argument("--spec-steps", type=_int_at_least(0), default=100,
                        help="speculative-decoding table (k=3 drafts per request, and without, at each "
                             "--sizes N >= 256, else N=256): timed steps (0 skips it; default 100)")
    parser.add_argument("--spec-form", choices=("packed", "vllm"), default="packed",
                        help="speculative-decoding table: the cached requests' drafts and block appends as "
                             "arrays (packed_cached, the form attnplug's scheduler sends; default) or as "
                             "vLLM's dict of lists and new_block_ids lists")
    parser.add_argument("--state-spec-steps", type=_int_at_least(0), default=0,
                        help="hybrid table: a Mamba2 and a GDN group's step with k=3 drafts for N=64 requests beside "
                             "decodes and the same tokens as prefill chunks (bench/spec_state.py): timed steps "
                             "(default 0: skipped; 20 is enough)")
    parser.add_argument("--json", action="store_true", help="print every figure as JSON instead of tables")
    parser.add_argument("--repeat", type=_int_at_least(1), default=3,
                        help="replay each workload this many times and report the run with the lowest "
                             "median total (default 3; the naive implementation runs once)")
    threads.add_flag(parser, "1 (host-side stages, reproducible on a shared machine)")
    return parser


def _step_compiler_rows(args, report: dict) -> list:
    """The step-compiler table (steady decode at each size, the trace replay): printed unless
    ``--json``; its figures in ``report["step_compiler"]``. Returns the table's rows."""
    rows, json_rows = [], []
    workloads = [] if args.no_compiler else [
        (steady_decode(n, max(args.steps, 0 if args.no_naive else args.naive_steps),
                       prompt_arrays=args.prompt_arrays), args.steps, TARGETS_US.get(n)) for n in args.sizes]
    if args.trace_steps > 0 and not args.no_compiler:
        workloads.append((trace_replay(args.trace_steps + 10), args.trace_steps, None))
    for w, steps, target in workloads:
        ours, numpy_path = _ours_and_numpy(args, w, steps)
        naive = None if args.no_naive else time_naive(w, min(args.naive_steps, steps))
        rows.append((w.name, _best(ours), _best(numpy_path), naive, target))
        json_rows.append(dict(workload=w.name, ours=_spread(ours), numpy_path=_spread(numpy_path), naive=naive,
                              target_us=target))
    report["step_compiler"] = json_rows
    text = render(rows, args.markdown) if rows and not args.json else ""
    if text:
        print(text)
    if args.trace_steps > 0 and not args.no_compiler and not args.json:
        print(f"trace replay: request lengths from the bundled trace `conv`, {BUNDLED_ATTRIBUTION}.")
    return rows


def _other_tables(args, report: dict, after_rows: bool) -> None:
    """The hybrid-metadata, builders, async, speculative and state-speculative tables, each
    when its step count is > 0: printed unless ``--json``, figures into ``report``."""
    sizes = args.sizes
    if args.hybrid_steps > 0:
        from attnplug.runner.commands.bench.metadata import render_hybrid, run_hybrid

        name, hybrid = run_hybrid(args.hybrid_steps, args.repeat)
        report["hybrid_metadata"] = dict(workload=name, **hybrid)
        text = "" if args.json else render_hybrid(name, hybrid, args.markdown)
        if text:
            print(("\n" if after_rows else "") + text)
    if args.builder_steps > 0:
        from attnplug.runner.commands.bench.builders import render_builders, run_builders, run_full_step

        trace = min(args.trace_steps, args.builder_steps)
        report["builders"] = run_builders(sizes, args.builder_steps, trace, args.repeat)
        report["full_step"] = run_full_step(sizes, args.builder_steps, trace, args.repeat)
        text = "" if args.json else render_builders(report["builders"], report["full_step"], args.markdown)
        if text:
            print("\n" + text)
    if args.async_steps > 0:
        from attnplug.runner.commands.bench.async_inputs import render_async, run_async

        report["async_prepare"] = run_async([n for n in sizes if n >= 64] or sizes, args.async_steps, args.repeat)
        if not args.json:
            print("\n" + render_async(report["async_prepare"], args.markdown))
    if args.spec_steps > 0:  # runner/commands/bench/spec_decode.py
        from attnplug.runner.commands.bench.spec_decode import render_spec, run_spec

        spec_sizes = [n for n in sizes if n >= 256] or [256]
        report["spec_decode"] = [row for n in spec_sizes for row in run_spec(
            n, 3, args.spec_steps, args.repeat, kernels_available() and not args.no_numpy, args.spec_form)]
        if not args.json:
            print("\n" + render_spec(report["spec_decode"], args.markdown))
    if args.state_spec_steps > 0:  # runner/commands/bench/spec_state.py: a hybrid model's state group
        from attnplug.runner.commands.bench.spec_state import render_spec_state, run_spec_state

        report["spec_state"] = run_spec_state(64, 3, args.state_spec_steps, args.repeat)
        if not args.json:
            print("\n" + render_spec_state(report["spec_state"], args.markdown))


def main(argv: list[str] | None = None) -> int:
    """``attnplug bench step [--steps N] [--sizes 16,64,...] [--trace-steps N] ...``"""
    if (status := _subcommand(argv or [])) is not None:
        return status
    args = _parser().parse_args(argv)
    if (status := threads.apply(args.torch_threads, "attnplug bench", default=1)) is not None:
        return status
    report = {"torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
              "repeat": args.repeat}
    rows = _step_compiler_rows(args, report)
    _other_tables(args, report, bool(rows))
    if args.json:
        print(json.dumps(report, indent=1))
    elif args.builder_steps > 0 or args.async_steps > 0 or args.spec_steps > 0 or args.state_spec_steps > 0 or rows:
        print(f"torch threads: {report['torch_threads']}; load average at start: "
              + ", ".join(f"{x:.2f}" for x in report["load_average"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
