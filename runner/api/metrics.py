"""``/metrics``: the server's figures in the Prometheus text format (``prometheus_client``).

Every server has its own ``CollectorRegistry`` (several can live in one process: tests).
Gauges are read from the engine thread's last :class:`~attnplug.runner.api.engine_loop.LoopStats`
at scrape time; latencies are observed as each request finishes, from its
:class:`~attnplug.runner.serve.request_timing.RequestTiming` (the definitions of
``runner/commands/serving_metrics.py``: TTFT = first token minus arrival, ITL = each gap
between two steps that made tokens visible, E2E = last token minus arrival; arrival is
when the server received the request). Names (``attnplug_`` prefix; vLLM's counterparts
use ``vllm:``):

==========================================  =======  =========================================
``attnplug_num_requests_running``           gauge    requests the scheduler runs
``attnplug_num_requests_waiting``           gauge    admitted, not running yet
``attnplug_kv_cache_blocks_in_use``         gauge    per ``group`` (index) and ``kind``
``attnplug_kv_cache_blocks_total``          gauge    the group's pool capacity
``attnplug_prefix_cache_queries_total``     counter  prompt tokens looked up
``attnplug_prefix_cache_hits_total``        counter  of those, found cached
``attnplug_prefix_cache_hit_rate``          gauge    hits / queries (0 with none)
``attnplug_spec_decode_draft_tokens_total`` counter  draft tokens proposed
``attnplug_spec_decode_accepted_tokens_total`` counter  of those, accepted
``attnplug_spec_decode_acceptance_rate``    gauge    accepted / proposed (0 with none)
``attnplug_torch_num_threads``              gauge    ``torch.get_num_threads()`` (timing tables record it)
``attnplug_engine_steps_total``             counter  engine steps run
``attnplug_engine_failed_steps_total``      counter  steps that raised
``attnplug_request_success_total``          counter  per ``finished_reason``: finished, aborted, error
``attnplug_prompt_tokens_total``            counter  prompt tokens of finished requests
``attnplug_generation_tokens_total``        counter  output tokens of finished requests
``attnplug_time_to_first_token_seconds``    histogram
``attnplug_inter_token_latency_seconds``    histogram
``attnplug_e2e_request_latency_seconds``    histogram
==========================================  =======  =========================================
"""

from __future__ import annotations

from typing import Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
"""Seconds (vLLM's TTFT buckets up to 80 s)."""


class _StatsCollector:
    """Gauges and engine counters read from ``stats()`` (a ``LoopStats``) at scrape time."""

    def __init__(self, stats: Callable):
        self._stats = stats

    def describe(self):
        return []

    def collect(self):
        s = self._stats()
        yield GaugeMetricFamily("attnplug_num_requests_running", "Requests the scheduler runs.", s.running)
        yield GaugeMetricFamily("attnplug_num_requests_waiting", "Requests admitted, not running yet.", s.waiting)
        used = GaugeMetricFamily("attnplug_kv_cache_blocks_in_use", "KV blocks (or state slots) requests own.",
                                 labels=["group", "kind"])
        total = GaugeMetricFamily("attnplug_kv_cache_blocks_total", "Blocks of the group's pool (null block "
                                  "excluded).", labels=["group", "kind"])
        for g, (u, t, k) in enumerate(zip(s.blocks_in_use, s.blocks_total, s.group_kinds)):
            used.add_metric([str(g), k], u)
            total.add_metric([str(g), k], t)
        yield used
        yield total
        yield CounterMetricFamily("attnplug_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_queries)
        yield CounterMetricFamily("attnplug_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  s.prefix_hits)
        yield GaugeMetricFamily("attnplug_prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens).",
                                s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
        yield CounterMetricFamily("attnplug_spec_decode_draft_tokens", "Draft tokens proposed.", s.spec_drafts)
        yield CounterMetricFamily("attnplug_spec_decode_accepted_tokens", "Draft tokens accepted.", s.spec_accepted)
        yield GaugeMetricFamily("attnplug_spec_decode_acceptance_rate", "Accepted / proposed draft tokens.",
                                s.spec_accepted / s.spec_drafts if s.spec_drafts else 0.0)
        yield GaugeMetricFamily("attnplug_torch_num_threads", "torch.get_num_threads() of the server.",
                                torch.get_num_threads())
        yield from _kv_connector_metrics(s.kv_connector)
        yield CounterMetricFamily("attnplug_engine_steps", "Engine steps run.", s.steps)
        yield CounterMetricFamily("attnplug_engine_failed_steps", "Engine steps that raised.", s.failed_steps)


def _kv_connector_metrics(kv: dict | None):
    """``--kv-connector``: its counters (docs/kv-connectors.md); nothing without a connector."""
    if kv is None:
        return
    for key, name, doc in [("query_tokens", "query_tokens", "Tokens the KV store was asked for."),
                           ("hit_tokens", "hit_tokens", "Tokens the KV store held."),
                           ("tokens_loaded", "loaded_tokens", "Tokens loaded from the KV store."),
                           ("bytes_loaded", "loaded_bytes", "Bytes loaded from the KV store."),
                           ("tokens_saved", "saved_tokens", "Tokens saved to the KV store."),
                           ("bytes_saved", "saved_bytes", "Bytes saved to the KV store."),
                           ("load_seconds", "load_seconds", "Seconds KV loads took (fetch, checks, copy).")]:
        yield CounterMetricFamily(f"attnplug_kv_connector_{name}", doc, kv[key])
    yield GaugeMetricFamily("attnplug_kv_connector_hit_rate", "KV store hits / queries (tokens).",
                            kv["hit_tokens"] / kv["query_tokens"] if kv["query_tokens"] else 0.0)
    faults = CounterMetricFamily("attnplug_kv_connector_faults", "KV connector faults (the request recomputed).",
                                 labels=["kind"])
    for kind, n in sorted(kv["faults"].items()):
        faults.add_metric([kind], n)
    yield faults


class ServerMetrics:
    """The registry of one server and the per-request observations.

    Args:
        stats: returns the engine loop's latest ``LoopStats`` (read at scrape time).
    """

    def __init__(self, stats: Callable):
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats))
        r = self.registry
        self.requests = Counter("attnplug_request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("attnplug_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("attnplug_generation_tokens", "Output tokens of finished requests.",
                                         registry=r)
        self.ttft = Histogram("attnplug_time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("attnplug_inter_token_latency_seconds", "Gap between two steps' tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("attnplug_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)

    def on_finish(self, timing, prompt_len: int, output_len: int, reason: str) -> None:
        """One finished request (``EngineLoop``'s ``on_finish``; thread-safe)."""
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt_len)
        self.generation_tokens.inc(output_len)
        if timing is None or not timing.chunk_times:
            return
        self.ttft.observe(timing.ttft)
        for gap in timing.itl:
            self.itl.observe(gap)
        self.e2e.observe(timing.e2el)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
