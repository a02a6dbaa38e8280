"""Serving figures of a run, with ``vllm bench serve``'s names and definitions
(``vllm/benchmarks/serve.py``: ``calculate_metrics`` and the result file's keys).

Per request, from its :class:`~attnplug.runner.serve.request_timing.RequestTiming`
(seconds on the engine's clock, counted from the request's arrival):

* TTFT: first chunk of tokens minus arrival;
* E2EL: last chunk minus arrival;
* TPOT: ``(E2EL - TTFT) / (output_tokens - 1)``, only for requests with more than one
  output token (for goodput a request with one token has TPOT 0);
* ITL: every gap between two consecutive chunks. A step that makes several tokens visible
  at once (speculative decoding) is one chunk, hence one ITL value, as one streamed chunk
  is in vLLM; so with speculation mean ITL exceeds mean TPOT.

Over the run: ``mean_X_ms``, ``median_X_ms``, ``std_X_ms`` (numpy's population standard
deviation) and ``pP_X_ms`` (``numpy.percentile``'s linear interpolation; ``p99``,
``p99.9``) for X in ttft, tpot, itl, e2el (0 when there is no value, as vLLM's
``np.mean(x or 0)``); ``duration`` (s, from the start of the measured run to the last
request's last token); ``request_throughput = completed / duration``,
``output_throughput = total_output_tokens / duration``, ``total_token_throughput =
(total_input_tokens + total_output_tokens) / duration``, and ``request_goodput``: the
requests that met every service-level objective of ``--goodput`` (``metric <= SLO``) per
second (``None`` without ``--goodput``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from attnplug.runner.serve.request_timing import RequestTiming

DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)
"""Percentiles reported by default (vLLM's default is 99 alone; the issue asks for p90 too)."""

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
"""The service-level objectives ``--goodput`` accepts (vLLM's names), milliseconds."""

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises:
        ValueError: one line naming the bad pair: not ``KEY:VALUE``, an unknown key, a
            key given twice, or a value that is not a finite number ``>= 0``.
    """
    out: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition(":")
        if not sep or ":" in value:
            raise ValueError(f"--goodput {pair!r}: expected KEY:MS, e.g. ttft:500")
        if key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: unknown metric {key!r}; one of {', '.join(GOODPUT_METRICS)}")
        if key in out:
            raise ValueError(f"--goodput {pair!r}: {key} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if not (math.isfinite(ms) and ms >= 0):
            raise ValueError(f"--goodput {pair!r}: the objective must be a finite number of ms >= 0")
        out[key] = ms
    return out


def percentile_key(p: float, metric: str) -> str:
    """``p99_ttft_ms``, ``p99.9_itl_ms`` (vLLM's spelling: an integral percentile loses its ``.0``)."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def _stats(metric: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    x = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{metric}_ms": float(x.mean()), f"median_{metric}_ms": float(np.median(x)),
           f"std_{metric}_ms": float(x.std())}
    for p in percentiles:
        out[percentile_key(p, metric)] = float(np.percentile(x, p))
    return out


def request_tpot(timing: RequestTiming, output_tokens: int) -> float | None:
    """``(e2el - ttft) / (output_tokens - 1)`` seconds; ``None`` for fewer than 2 tokens."""
    if output_tokens < 2 or not timing.chunk_times:
        return None
    return (timing.e2el - timing.ttft) / (output_tokens - 1)


def serving_metrics(timings: Sequence[RequestTiming], prompt_lens: Sequence[int], output_lens: Sequence[int],
                    duration_s: float, goodput: dict[str, float] | None = None,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The run's figures under vLLM's result-file keys (module docstring).

    Args:
        timings: one per measured request.
        prompt_lens: its prompt tokens (same order).
        output_lens: its output tokens (same order).
        duration_s: the measured run's length, seconds (``> 0``).
        goodput: ``parse_goodput``'s dict, or ``None``.
        percentiles: in ``(0, 100]``.

    Returns:
        A dict of floats and ints; a request that made no token counts as failed.

    Raises:
        ValueError: lists of different lengths or ``duration_s <= 0``.
    """
    if not len(timings) == len(prompt_lens) == len(output_lens):
        raise ValueError("timings, prompt_lens and output_lens must have one entry per request")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    ttfts, tpots, itls, e2els, good = [], [], [], [], 0
    total_in = total_out = completed = 0
    slo_s = {k: v / 1000.0 for k, v in (goodput or {}).items()}
    for timing, n_in, n_out in zip(timings, prompt_lens, output_lens):
        if not timing.chunk_times:
            continue
        completed += 1
        total_in, total_out = total_in + n_in, total_out + n_out
        tpot = request_tpot(timing, n_out)
        ttfts.append(timing.ttft)
        e2els.append(timing.e2el)
        itls.extend(timing.itl)
        if tpot is not None:
            tpots.append(tpot)
        mine = {"ttft": timing.ttft, "tpot": tpot or 0.0, "e2el": timing.e2el}
        good += all(mine[k] <= s for k, s in slo_s.items())
    out: dict[str, Any] = {
        "duration": duration_s, "completed": completed, "failed": len(timings) - completed,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    for metric, values in zip(LATENCY_METRICS, (ttfts, tpots, itls, e2els)):
        out.update(_stats(metric, values, percentiles))
    return out
