"""The engine in its own thread: requests join it as they arrive (continuous batching).

One :class:`EngineLoop` owns an :class:`~attnplug.runner.serve.engine.LLMEngine` (the
scheduler and runner of ``attnplug run``, built by the same code) and is the only thread
that touches it. HTTP handlers, on the asyncio loop, talk to it through a locked inbox:
:meth:`EngineLoop.submit` (a validated request, with the ``asyncio.Queue`` its updates go
to) and :meth:`EngineLoop.abort` (a client went away, or a stop string ended it). Between
two steps the thread adds what arrived and aborts what was asked, steps the engine, and
sends each request the tokens the step made visible (:class:`Update`, through
``loop.call_soon_threadsafe``). With nothing to run it waits on an event, after a flush
step that tells the runner which requests finished (as ``LLMEngine.run`` ends).

A step that raises fails the requests of that step (``StepFailed``): each gets an
:class:`Update` with ``error`` set, their blocks go back to the pools, and the loop goes
on with the others. Finished requests leave the engine's ``results`` / ``timings`` as
they are sent, and the scheduler's ``requests`` once nothing needs them
(``runner/serve/retention.py``), so a long-running server keeps no per-request state.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from attnplug.core.errors import SchedulingError
from attnplug.runner.serve.kv_loads import connector_counters
from attnplug.runner.serve.request_timing import RequestTiming
from attnplug.runner.serve.retention import forget_finished
from attnplug.runner.serve.step_failure import StepFailed
from attnplug.runner.step.scheduler_output import SamplingParams

log = logging.getLogger("attnplug.api")


@dataclass
class Update:
    """What one step made visible of one request (data only).

    Attributes:
        token_ids: the new output token ids (may be empty on the last update).
        finished: no more updates follow.
        error: the step failed (the exception's one-line message); ``finished`` is set.
    """

    token_ids: list[int]
    finished: bool = False
    error: str | None = None


@dataclass
class Submission:
    """A validated request on its way to the engine thread (data only).

    Attributes:
        req_id: a new, unique id.
        prompt_token_ids: the prompt, ``1 <= len < max_model_len``.
        sampling_params: already checked against the engine (``admission.check_new_request``).
        arrival_time: when the server received it, on the engine's clock (seconds).
        deliver: ``Update -> None``, called on the engine thread (it must hand the update
            to the asyncio loop itself, e.g. ``loop.call_soon_threadsafe(queue.put_nowait, u)``).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    deliver: Callable[[Update], None]


@dataclass
class _Live:
    sub: Submission
    chunks_seen: int = 0
    sent: int = 0


@dataclass
class LoopStats:
    """The engine's state after the last step, for ``/metrics`` (data only).

    ``blocks_in_use`` / ``blocks_total``: per cache group (blocks requests own; the pool's
    capacity, null block excluded). ``prefix_queries`` / ``prefix_hits``: prompt tokens looked
    up in the prefix cache / found there. ``spec_drafts`` / ``spec_accepted``: draft tokens
    proposed / accepted. ``kv_connector``: with ``--kv-connector``, the connector's counters
    (``runner/commands/kv_connector_setup.py``'s ``kv_connector_summary`` keys), else ``None``."""

    running: int = 0
    waiting: int = 0
    blocks_in_use: list[int] = field(default_factory=list)
    blocks_total: list[int] = field(default_factory=list)
    group_kinds: list[str] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_drafts: int = 0
    spec_accepted: int = 0
    steps: int = 0
    failed_steps: int = 0
    kv_connector: dict | None = None


class EngineLoop:
    """Runs ``engine`` on a daemon thread (module docstring).

    Args:
        engine: an ``LLMEngine`` nobody else steps.
        max_pending: requests admitted but not finished, at most (``submit`` refuses more).
        on_finish: ``(timing, prompt_len, output_len, reason)`` per finished request, on the
            engine thread (metrics); ``reason`` is ``"finished"``, ``"aborted"`` or ``"error"``.
    """

    def __init__(self, engine, max_pending: int,
                 on_finish: Callable[[RequestTiming | None, int, int, str], None] | None = None):
        self.engine = engine
        engine.survive_step_errors = True
        self.max_pending = max_pending
        self.on_finish = on_finish
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[Submission] = []
        self._aborts: list[tuple[str, str]] = []
        self._live: dict[str, _Live] = {}
        self._num_pending = 0
        self._stopping = False
        self._dirty = False  # requests finished since the last flush step
        self._done: list[str] = []  # finished, still in Scheduler.requests (retention.py)
        self.stats = LoopStats()
        self._thread = threading.Thread(target=self._run, name="attnplug-engine", daemon=True)

    def start(self) -> None:
        self._snapshot()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        """The engine thread runs."""
        return self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished yet."""
        return self._num_pending

    def submit(self, sub: Submission) -> bool:
        """Hand ``sub`` to the engine thread; ``False`` (nothing queued) when ``max_pending``
        requests are already pending."""
        with self._lock:
            if self._num_pending >= self.max_pending:
                return False
            self._num_pending += 1
            self._adds.append(sub)
        self._wake.set()
        return True

    def abort(self, req_id: str, reason: str = "aborted") -> None:
        """Stop ``req_id`` at the next step boundary; no more updates are sent for it (an
        unknown or finished id is ignored). ``reason``: for ``on_finish`` (a stop string
        ends a request as ``"finished"``)."""
        with self._lock:
            self._aborts.append((req_id, reason))
        self._wake.set()

    # --- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._take_inbox()
            if not self.engine.has_unfinished_requests():
                if self._dirty:
                    self._flush()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except StepFailed as e:
                log.error("%s", e, exc_info=e.cause)
                self.stats.failed_steps += 1
                for rid in (r for r in e.req_ids if r in self._live):
                    self._finish(rid, f"the engine step failed: {type(e.cause).__name__}: {e.cause}")
            except Exception as e:  # the scheduler itself: fail everything it holds, go on
                log.exception("engine loop error")
                self.stats.failed_steps += 1
                for rid in list(self._live):
                    self._abort_in_engine(rid)
                    self._finish(rid, f"the engine failed: {type(e).__name__}: {e}")
            self._publish()
            self._done = forget_finished(self.engine.scheduler, self._done)
            self._snapshot()

    def _take_inbox(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        for sub in adds:
            try:
                self.engine.add_request(sub.req_id, sub.prompt_token_ids, sub.sampling_params,
                                        arrival_time=sub.arrival_time)
            except Exception as e:  # checked by the handler already; never take the loop down
                self._live[sub.req_id] = _Live(sub)
                self._finish(sub.req_id, f"the engine refused the request: {e}", in_engine=False)
                continue
            self._live[sub.req_id] = _Live(sub)
        for rid, reason in aborts:
            if rid in self._live:
                self._abort_in_engine(rid)
                self._finish(rid, None, reason=reason, send=False)

    def _abort_in_engine(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except SchedulingError:
            pass  # finished in the step that just ran

    def _publish(self) -> None:
        eng = self.engine
        for rid in list(self._live):
            live = self._live[rid]
            if rid in eng.results:
                self._finish(rid, None)
                continue
            timing = eng.timings.get(rid)
            if timing is None or len(timing.chunk_tokens) == live.chunks_seen:
                continue
            live.chunks_seen = len(timing.chunk_tokens)
            outs = eng.output_token_ids(rid)
            new, live.sent = outs[live.sent:], len(outs)
            live.sub.deliver(Update(new))

    def _finish(self, rid: str, error: str | None, reason: str | None = None, send: bool = True,
                in_engine: bool = True) -> None:
        """Send ``rid``'s last update and drop every trace of it from the engine."""
        live = self._live.pop(rid)
        res = self.engine.results.pop(rid, None) if in_engine else None
        timing = self.engine.timings.pop(rid, None) if in_engine else None
        outs = list(res.output_token_ids) if res is not None else []
        if send:
            live.sub.deliver(Update(outs[live.sent:], finished=True, error=error))
        with self._lock:
            self._num_pending -= 1
        self._dirty = True
        if in_engine:
            self._done.append(rid)
        if self.on_finish is not None:
            self.on_finish(timing, len(live.sub.prompt_token_ids), len(outs),
                           reason or ("error" if error else "finished"))

    def _flush(self) -> None:
        """An empty step: the runner forgets the requests that finished (``LLMEngine.run``)."""
        sched = self.engine.scheduler
        try:
            flush = sched.schedule()
            self.engine.runner.execute_model(flush)
            sched.update_from_output(flush, {})
        except Exception:
            log.exception("flush step failed")
        self._dirty = False
        self._done = forget_finished(sched, self._done)
        self._snapshot()

    def _snapshot(self) -> None:
        sched = self.engine.scheduler
        kv = sched.kv_cache_manager
        s = LoopStats(running=len(sched.running), waiting=len(sched.waiting) + len(self._adds),
                      blocks_in_use=[p.num_used_blocks for p in kv.pools],
                      blocks_total=[p.capacity for p in kv.pools],
                      group_kinds=[str(getattr(spec.kind, "value", spec.kind)) for spec in _specs(kv)],
                      steps=self.engine.stats.num_steps, failed_steps=self.stats.failed_steps)
        pc = getattr(kv, "stats", None)
        if pc is not None:
            s.prefix_queries, s.prefix_hits = pc.queries, pc.hits
        if sched.spec is not None:
            s.spec_drafts, s.spec_accepted = sched.spec.stats.num_draft_tokens, sched.spec.stats.num_accepted_tokens
        s.kv_connector = connector_counters(self.engine)
        self.stats = s


def _specs(kv) -> list[Any]:
    specs = getattr(kv, "specs", None)
    if specs is not None:
        return list(specs)
    return [m.spec for m in kv.managers]


__all__ = ["EngineLoop", "LoopStats", "Submission", "Update"]
