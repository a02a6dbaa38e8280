"""``attnplug run``'s serving flags: when requests arrive, how they sample, what is measured.

Registered by :func:`add_flags`, checked by :func:`check` (one line, exit 2, before any
model is built), turned into a :class:`ServingPlan` by :func:`plan`. Arrivals follow
``vllm bench serve`` (``runner/serve/arrivals.py``): ``--request-rate`` (with
``--burstiness``), or a trace's own timestamps (``--trace-timestamps``, the default of a
timed-trace ``.jsonl`` as vLLM's ``--self-timed`` is), scaled by ``--time-scale``;
without either every request arrives at ``t = 0``. docs/configuration.md lists the flags.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnplug.runner.commands.limits import bounded_int, clip
from attnplug.runner.commands.serving_metrics import DEFAULT_PERCENTILES, parse_goodput
from attnplug.runner.commands.timed_trace import CHUNK_HASH_SIZE, is_timed_trace
from attnplug.runner.serve.arrivals import rate_arrivals, trace_arrivals
from attnplug.runner.step.scheduler_output import SamplingParams


def _number(low: float, *, low_ok: bool, high: float = math.inf, high_ok: bool = False, inf_ok: bool = False):
    """An argparse ``type=``: a decimal number in the range (``inf`` only with ``inf_ok``)."""
    if math.isinf(high):
        what = f"a finite number {'>=' if low_ok else '>'} {low:g}" + (" or inf" if inf_ok else "")
    else:
        what = f"a number in {'[' if low_ok else '('}{low:g}, {high:g}{']' if high_ok else ')'}"

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {clip(text)}") from None
        if math.isinf(value) and value > 0 and inf_ok:
            return value
        ok = math.isfinite(value) and (value >= low if low_ok else value > low) \
            and (value <= high if high_ok else value < high)
        if not ok:
            raise argparse.ArgumentTypeError(f"{text.strip()} is out of range: expected {what}")
        return value

    parse.__name__ = "number"
    return parse


def add_flags(p: argparse.ArgumentParser) -> None:
    """Register the serving flags on ``attnplug run``'s parser."""
    when = p.add_mutually_exclusive_group()
    when.add_argument("--request-rate", type=_number(0, low_ok=False, inf_ok=True), default=None, metavar="R",
                      help="requests arrive at R per second: Poisson, or Gamma with --burstiness "
                           "(vllm bench serve's arrivals); inf: all at t=0 (the default)")
    when.add_argument("--trace-timestamps", action="store_true",
                      help="requests arrive at the trace's own times (the default of a timed-trace .jsonl)")
    p.add_argument("--burstiness", type=_number(0, low_ok=False, inf_ok=True), default=None, metavar="B",
                   help="with --request-rate: Gamma shape of the gaps between arrivals (mean 1/R); "
                        "1 = Poisson (default), < 1 burstier, > 1 more regular, inf constant")
    p.add_argument("--time-scale", type=_number(0, low_ok=False), default=None, metavar="S",
                   help="with trace timestamps: multiply them by S (0.1 replays ten times faster; default 1)")
    p.add_argument("--timed-trace-chunk-hash-size", type=bounded_int(1, 2**20), default=CHUNK_HASH_SIZE,
                   metavar="N", help="a timed trace's tokens per hash id (Mooncake traces: 512)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="service-level objectives for request_goodput: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--metric-percentiles", default=",".join(f"{q:g}" for q in DEFAULT_PERCENTILES),
                   metavar="P,P", help="percentiles of TTFT / TPOT / ITL / E2EL to report, in (0, 100]")
    p.add_argument("--warmup", type=bounded_int(0, 100_000), default=0, metavar="N",
                   help="warm-up requests run first and left out of every figure")
    p.add_argument("--repeat", type=bounded_int(1, 1000), default=1, metavar="N",
                   help="measured runs (a fresh engine each); figures of the median run, plus min / median / max")
    p.add_argument("--temperature", type=_number(0, low_ok=True), default=0.0, metavar="T",
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=_number(0, low_ok=False, high=1, high_ok=True), default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens of mass >= P")
    p.add_argument("--top-k", type=bounded_int(0, 2**31 - 1), default=0, metavar="K",
                   help="keep the K most likely tokens (0: off)")
    p.add_argument("--output-len", type=bounded_int(1, 2**20), default=None, metavar="N",
                   help="every request's output tokens (max_tokens), instead of the trace's")


def percentiles(text: str) -> tuple[float, ...]:
    """``"90,99"`` -> ``(90.0, 99.0)``.

    Raises:
        ValueError: an empty list, or a value that is not a number in ``(0, 100]``.
    """
    out = []
    for part in text.split(","):
        try:
            q = float(part)
        except ValueError:
            raise ValueError(f"--metric-percentiles: {clip(part.strip())} is not a number") from None
        if not 0 < q <= 100:
            raise ValueError(f"--metric-percentiles: {q:g} is not in (0, 100]")
        out.append(q)
    return tuple(out)


def check(args) -> str | None:
    """Why the serving flags do not go together (one line), or ``None``."""
    timed = args.trace_timestamps or is_timed_trace(args.trace)
    if args.burstiness is not None and args.request_rate is None:
        return "--burstiness shapes --request-rate's arrivals: give --request-rate too"
    if args.time_scale is not None and (not timed or args.request_rate is not None):
        return "--time-scale scales trace timestamps: give --trace-timestamps (or a timed-trace .jsonl) " \
               "and no --request-rate"
    if args.repeat > 1 and getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1) > 1:
        return "--repeat builds a fresh engine per run: not with tensor or pipeline parallelism"
    try:
        if args.goodput is not None:
            parse_goodput(args.goodput)
        percentiles(args.metric_percentiles)
    except ValueError as e:
        return str(e)
    return None


@dataclass
class ServingPlan:
    """What ``attnplug run`` replays beyond the requests themselves.

    Attributes:
        arrival_s: per request id (``EngineSetup.prompts`` order), seconds after the
            measured run starts.
        arrivals: how they were made, for the summary: ``mode``, ``request_rate`` (``"inf"``
            or requests/s, vLLM's spelling), ``burstiness``, ``time_scale``.
        warmup: ``(req_id, prompt, SamplingParams)`` of the warm-up requests.
        goodput: the objectives, ms (``None`` without ``--goodput``).
        percentiles: reported percentiles.
    """

    arrival_s: dict[str, float]
    arrivals: dict[str, Any]
    warmup: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    goodput: dict[str, float] | None = None
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES


def _arrivals(args, setup) -> tuple[np.ndarray, dict[str, Any]]:
    n = len(setup.prompts)
    if args.request_rate is not None and math.isfinite(args.request_rate):
        b = 1.0 if args.burstiness is None else args.burstiness
        mode = "poisson" if b == 1.0 else ("constant" if math.isinf(b) else "gamma")
        times = rate_arrivals(n, args.request_rate, b, seed=args.seed)
        return times, {"mode": mode, "request_rate": args.request_rate, "burstiness": b}
    if args.request_rate is None and (args.trace_timestamps or is_timed_trace(args.trace)):
        scale = 1.0 if args.time_scale is None else args.time_scale
        times = trace_arrivals([setup.trace_arrival_s[rid] for rid in setup.prompts], scale)
        return times, {"mode": "trace timestamps", "request_rate": "inf", "burstiness": 1.0, "time_scale": scale}
    return np.zeros(n), {"mode": "all at t=0", "request_rate": "inf", "burstiness": 1.0}


def plan(args, setup) -> ServingPlan:
    """Arrivals, warm-up requests and objectives of a run (flags already :func:`check`-ed).

    Warm-up request ``j`` has the prompt length and sampling of measured request
    ``j mod N`` and fresh tokens (a ``default_rng([seed, 5_000_000, j])`` stream), so it
    shares no prefix with the measured prompts; warm-up requests all arrive at once.
    """
    times, info = _arrivals(args, setup)
    rids = list(setup.prompts)
    warm = []
    vocab = setup.model.config.vocab_size
    for j in range(args.warmup if rids else 0):
        src = rids[j % len(rids)]
        prompt = np.random.default_rng([args.seed, 5_000_000, j]).integers(0, vocab, len(setup.prompts[src])).tolist()
        warm.append((f"warmup-{j}", prompt, setup.sampling_params[src]))
    return ServingPlan({rid: float(t) for rid, t in zip(rids, times)}, info, warm,
                       parse_goodput(args.goodput) if args.goodput else None, percentiles(args.metric_percentiles))


def sampling_params(args, index: int, output_len: int) -> SamplingParams:
    """Request ``index``'s sampling: the trace's ``output_len`` unless ``--output-len``;
    ``--temperature`` / ``--top-p`` / ``--top-k``; with temperature > 0 its own seed, drawn
    from ``(--seed, index)``, so its tokens do not depend on the batch it runs in."""
    temperature = float(getattr(args, "temperature", 0.0) or 0.0)
    seed = None
    if temperature > 0:
        seed = int(np.random.SeedSequence([getattr(args, "seed", 0), index]).generate_state(1)[0])
    return SamplingParams(temperature=temperature, top_k=int(getattr(args, "top_k", 0) or 0),
                          top_p=float(getattr(args, "top_p", 1.0) or 1.0), seed=seed,
                          max_tokens=getattr(args, "output_len", None) or output_len)
