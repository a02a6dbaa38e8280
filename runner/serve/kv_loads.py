"""The scheduler's side of KV connector loads (``core/kv_connector.py``).

At admission a waiting request asks the connector how many tokens beyond its local prefix
hit it can provide. When it can (``n > 0``), :meth:`RemoteKVLoads.start` allocates blocks
for ``local + n`` tokens, tells the connector where they are, and parks the request in
``WAITING_FOR_REMOTE_KVS``: it is not scheduled for compute and takes no token budget,
though it counts against ``max_num_seqs``. The worker reports each load's outcome in
``ModelRunnerOutput.kv_connector_output``; :meth:`RemoteKVLoads.finish` then puts the
request back at the front of the waiting queue, holding its blocks, with
``num_computed_tokens = local + n`` (loaded) or ``local`` (failed: it recomputes the
rest, so a fault costs compute, never correctness). Its next admission schedules it as a
new request starting at that count (:meth:`RemoteKVLoads.admit_loaded`).

A request finished (aborted) while loading keeps its blocks until the load's outcome
arrives: the worker may still be writing into them.
"""

from __future__ import annotations

from typing import Any

from attnplug.core.errors import ConfigError
from attnplug.core.kv_connector import KVConnectorBase, KVConnectorOutput
from attnplug.runner.serve.request import Request, RequestStatus


class RemoteKVLoads:
    """The requests whose KV is loading, and the scheduler hooks around them.

    Args:
        scheduler: the owning ``Scheduler`` (its queues, ``kv_cache_manager``, ``_allocate``).
        connector: the scheduler-side connector instance.

    Raises:
        ConfigError: the scheduler runs asynchronously (not supported with a connector).
    """

    def __init__(self, scheduler: Any, connector: KVConnectorBase):
        if scheduler.config.async_scheduling:
            raise ConfigError("--kv-connector", "a KV connector needs synchronous scheduling "
                              "(drop --async-scheduling)")
        self.scheduler = scheduler
        self.connector = connector
        self.loading: dict[str, Request] = {}
        self.num_loaded = 0
        self.num_failed = 0
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self.loading)

    def lookup(self, req: Request, local: int) -> int:
        """Tokens the connector can provide beyond ``local`` (0 for a request that already
        loaded, failed, or was ever sent to the runner). Tokens the connector says another
        instance sampled (``take_remote_output_tokens``) become the request's first outputs."""
        if req.kv_load is not None or req.sent_to_runner:
            return 0
        n, _load_async = self.connector.get_num_new_matched_tokens(req, local)
        remote = self.connector.take_remote_output_tokens(req)  # a disaggregated prefill's first token
        if remote and not req.output_token_ids:
            req.output_token_ids.extend(int(t) for t in remote)
            req.kv_remote_tokens = len(remote)
        # attnplug always waits for the load's outcome before computing (load_async or not),
        # so a failed load can fall back to recomputation.
        return max(0, min(int(n), req.num_tokens - 1 - local))

    def start(self, req: Request, hit, n: int) -> bool:
        """Allocate blocks for ``hit + n`` tokens and park ``req`` (first in the waiting queue)
        until its load ends; ``False`` when a pool is short (nothing changed)."""
        sched = self.scheduler
        if sched._allocate(req, n, hit) is None:
            return False
        req.num_computed_tokens = hit.num_computed_tokens
        sched.kv_cache_manager.record_admission(req, hit)
        self.connector.update_state_after_alloc(req, req.block_ids, n)
        sched.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.kv_load = "loading"
        req.kv_load_tokens = n
        self.loading[req.req_id] = req
        return True

    def admit_loaded(self, req: Request, budget: int, stepping: bool) -> int | None:
        """Admit ``req`` (first waiting; its load ended, it holds blocks for its
        ``num_computed_tokens``) as running: the tokens it computes this step, or ``None``
        when it does not fit now.

        When its blocks cannot grow while nothing runs and nothing is scheduled yet
        (``stepping`` false), requests behind it that hold loaded blocks give them back, last
        first, until it fits (:meth:`_drop_held`): without that, requests that each hold part
        of the pool would wait for each other forever."""
        sched = self.scheduler
        total = req.num_tokens_to_compute
        if not sched.config.enable_chunked_prefill and total > budget:
            return None
        n = sched.kv_cache_manager.align_num_new_tokens(req, req.num_computed_tokens, min(total, budget))
        while sched._allocate(req, n) is None:
            if sched.running or stepping or not self._drop_held(req):
                return None
        sched.waiting.popleft()
        sched.running.append(req)
        req.status = RequestStatus.RUNNING
        req.sent_to_runner = True
        return n

    def _drop_held(self, front: Request) -> bool:
        """The last waiting request behind ``front`` that holds blocks from its load frees them
        and will compute from token 0 (``kv_load = "dropped"``); ``False`` when there is none."""
        for r in reversed(self.scheduler.waiting):
            if r is not front and r.kv_load in ("loaded", "failed") and not r.sent_to_runner and any(r.block_ids):
                self.scheduler.kv_cache_manager.free(r)
                r.block_ids = tuple([] for _ in r.block_ids)
                r.num_computed_tokens = 0
                r.kv_load = "dropped"
                self.num_dropped += 1
                return True
        return False

    def on_finish(self, req: Request) -> bool:
        """``req`` finished (aborted): tell the connector; ``True`` when it is loading (its
        blocks are then freed when the load ends, not now)."""
        self.connector.request_finished(req)
        return req.req_id in self.loading

    def finish(self, output: KVConnectorOutput | None) -> None:
        """Take the worker's outcomes: loaded or failed requests go back to the front of the
        waiting queue (arrival order), aborted ones free their blocks."""
        if not output:
            return
        sched = self.scheduler
        back = []
        for rid in sorted(output.finished_recving | output.failed_recving):
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            ok = rid in output.finished_recving and rid not in output.failed_recving
            self.num_loaded += ok
            self.num_failed += not ok
            if req.is_finished:  # aborted while loading
                sched.kv_cache_manager.free(req)
                continue
            req.kv_load = "loaded" if ok else "failed"
            if ok:
                req.num_computed_tokens += req.kv_load_tokens
            req.status = RequestStatus.WAITING
            back.append(req)
        for req in sorted(back, key=lambda r: r.arrival_index, reverse=True):
            sched.waiting.appendleft(req)


def connector_counters(engine) -> dict | None:
    """The KV connector's counters of ``engine`` (both sides), or ``None`` without one."""
    sched_conn = engine.scheduler.kv_connector
    work_conn = getattr(engine.runner, "kv_connector", None)
    if sched_conn is None or work_conn is None:
        return None
    s, w = sched_conn.stats, work_conn.stats
    faults = dict(s.faults)
    for k, v in w.faults.items():
        faults[k] = faults.get(k, 0) + v
    return {"lookups": s.lookups, "query_tokens": s.query_tokens, "hit_tokens": s.hit_tokens,
            "tokens_loaded": w.tokens_loaded,
            "bytes_loaded": w.bytes_loaded, "tokens_saved": w.tokens_saved, "bytes_saved": w.bytes_saved,
            "load_seconds": sum(w.load_time_ns) / 1e9,
            "load_ms_mean": sum(w.load_time_ns) / len(w.load_time_ns) / 1e6 if w.load_time_ns else 0.0,
            "faults": dict(sorted(faults.items()))}
