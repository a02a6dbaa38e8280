"""The engine loop: schedule → ``ModelRunner.execute_model`` → feed tokens back.

Partial prefills (and recomputes after preemption) produce no visible token: the runner
drops their rows, and the scheduler only advances their ``num_computed_tokens``.

With ``SchedulerConfig.async_scheduling`` one step is in flight: each ``step()`` schedules
and launches step t + 1 (its decode rows read step t's tokens on the device), then waits
for step t's outputs — the one wait per step, ``AsyncModelRunnerOutput.result()`` — and
feeds them to the scheduler, which corrects its optimistic plan.

Requests may arrive over time: ``add_request(..., arrival_time=t)`` on ``LLMEngine.clock``
(``runner/serve/clock.py``) holds the request, validated, until the clock reaches ``t``;
each step first admits every request that has arrived, and a step with nothing to run idles
(``clock.sleep``) until the next arrival. The engine records when each request arrived and
when each step made its tokens visible (``RequestTiming``, ``runner/serve/request_timing.py``),
from which ``attnplug run`` computes TTFT, TPOT, ITL and E2EL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from attnplug.core.errors import InvalidRequestError, InvalidSchedulerOutput
from attnplug.runner.execute.model_runner import ModelRunner
from attnplug.runner.serve.admission import check_new_request
from attnplug.runner.serve.arrival_queue import ArrivalQueue
from attnplug.runner.serve.clock import Clock, WallClock
from attnplug.runner.serve.request_timing import RequestTiming
from attnplug.runner.serve.scheduler import Scheduler
from attnplug.runner.serve.step_failure import StepFailed, abandon_in_flight
from attnplug.runner.step.multimodal import check_mm_features
from attnplug.runner.step.prompt_embeds import check_prompt_embeds
from attnplug.runner.step.scheduler_output import SamplingParams


@dataclass
class EngineStats:
    """Counters of an engine's life so far."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_scheduled_tokens: int = 0
    wall_time_s: float = 0.0


@dataclass
class RequestResult:
    """A finished request: its prompt, outputs, (when recorded) per-output logits, and its
    arrival and token times on the engine's clock."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)
    timing: RequestTiming | None = None


class LLMEngine:
    """Drives a scheduler and a model runner until every request finishes.

    Args:
        scheduler: emits one ``SchedulerOutput`` per step.
        runner: executes it.
        clock: arrival and token times, and idling (default :class:`WallClock`; a test
            injects a ``ManualClock``). Public: may be replaced before requests are added.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, clock: Clock | None = None):
        self.scheduler = scheduler
        self.runner = runner
        self.clock: Clock = clock if clock is not None else WallClock()
        self.stats = EngineStats()
        self.pending = ArrivalQueue()
        """Requests added with a future ``arrival_time``, not yet given to the scheduler."""
        self.timings: dict[str, RequestTiming] = {}
        self._prompts: dict[str, list[int]] = {}
        self._outputs: dict[str, list[int]] = {}
        self._logits: dict[str, list[torch.Tensor]] = {}
        self.results: dict[str, RequestResult] = {}
        self.async_scheduling = bool(scheduler.config.async_scheduling)
        self.survive_step_errors = False
        """A step that raises finishes its requests and raises :class:`StepFailed` naming them,
        and the engine can go on stepping (a server, ``runner/api/``); off: the exception
        propagates as it is and the engine is left as the step left it (``attnplug run``)."""
        self._in_flight: tuple | None = None
        """Asynchronous scheduling: ``(SchedulerOutput, AsyncModelRunnerOutput)`` of the step
        launched last, whose outputs are not read yet."""

    def add_request(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None, *, prompt_embeds: torch.Tensor | None = None,
                    mm_features: list | None = None) -> None:
        """Queue a request; a rejected one changes nothing.

        Args:
            arrival_time: when it arrives, on :attr:`clock` (seconds). ``None`` or a time
                already past: it goes to the scheduler now (its arrival is ``clock.now()``
                when ``None``). A later time: it waits in :attr:`pending`, already validated,
                and the first step at or after that time admits it.
            prompt_embeds: ``None``, or the prompt as embeddings, ``[len(prompt_token_ids),
                hidden_size]`` in the model dtype (the runner needs
                ``enable_prompt_embeds``; ``prompt_token_ids`` then only fix the length).
                Such a request never shares prefix-cache blocks.
            mm_features: ``None``, or the prompt's images in order (``MultiModalFeature``s,
                ``runner/step/multimodal.py``; the runner's model needs ``embed_image``):
                each one's placeholder tokens take its encoder output.

        Raises:
            InvalidRequestError: what ``Scheduler.add_request`` refuses (a pending id
                counts as used), a non-finite ``arrival_time``, or embeddings the runner
                would refuse (``runner/step/prompt_embeds.py``), images it would refuse
                (``runner/step/multimodal.py``), either given with a later
                ``arrival_time`` (not supported).
        """
        now = self.clock.now()
        arrival = now if arrival_time is None else float(arrival_time)
        if not arrival < float("inf") or arrival != arrival:
            raise InvalidRequestError(str(req_id), f"arrival_time must be a finite number, got {arrival_time!r}")
        if req_id in self.pending:
            raise InvalidRequestError(req_id, "duplicate request id; every request needs a new id")
        if prompt_embeds is not None:
            self._check_embeds(req_id, prompt_token_ids, prompt_embeds, arrival > now)
        if mm_features:
            self._check_images(req_id, prompt_token_ids, mm_features, arrival > now)
        if arrival <= now:
            self.scheduler.add_request(req_id, prompt_token_ids, sampling_params, prompt_embeds, mm_features)
        else:
            prompt_token_ids = check_new_request(self.scheduler.config, self.scheduler.kv_cache_manager,
                                                 self.scheduler.requests, req_id, prompt_token_ids, sampling_params)
            self.pending.push(arrival, req_id, prompt_token_ids, sampling_params)
        self.timings[req_id] = RequestTiming(arrival)
        self._prompts[req_id] = list(prompt_token_ids)
        self._outputs[req_id] = []
        self._logits[req_id] = []
        self.stats.num_prompt_tokens += len(prompt_token_ids)

    def _check_embeds(self, req_id, prompt_token_ids, prompt_embeds, later: bool) -> None:
        """Refuse embeddings stage 1 of the runner would refuse, before the request enters."""
        if later:
            raise InvalidRequestError(str(req_id), "prompt_embeds with a later arrival_time are not supported")
        probe = SimpleNamespace(req_id=req_id, prompt_token_ids=prompt_token_ids, prompt_embeds=prompt_embeds)
        try:
            check_prompt_embeds(self.runner.compiler.checker.prompt_embeds_config, [probe])
        except InvalidSchedulerOutput as e:
            raise InvalidRequestError(str(req_id), str(e)) from None

    def _check_images(self, req_id, prompt_token_ids, mm_features, later: bool) -> None:
        """Refuse images stage 1 of the runner would refuse, before the request enters."""
        if later:
            raise InvalidRequestError(str(req_id), "mm_features with a later arrival_time are not supported")
        probe = SimpleNamespace(req_id=req_id, prompt_token_ids=prompt_token_ids, mm_features=mm_features,
                                mm_placeholders=None)
        try:
            check_mm_features(self.runner.compiler.checker.mm_config, [probe])
        except InvalidSchedulerOutput as e:
            raise InvalidRequestError(str(req_id), str(e)) from None

    def abort_request(self, req_id: str) -> None:
        """Stop a request now (``Scheduler.abort_request``); its result keeps the outputs it
        had. With a step in flight, that step's sample for it is dropped.

        A request that has not arrived yet leaves :attr:`pending` with no outputs.

        Raises:
            SchedulingError: an unknown or finished request.
        """
        if req_id in self.pending:
            self.pending.remove(req_id)
            n = 0
        else:
            self.scheduler.abort_request(req_id)
            n = len(self.scheduler.get_request(req_id).output_token_ids)
        outs = self._outputs.pop(req_id)[:n]
        self.results[req_id] = RequestResult(req_id, self._prompts.pop(req_id), outs,
                                             self._logits.pop(req_id)[: len(outs)], self.timings.get(req_id))

    def output_token_ids(self, req_id: str) -> list[int]:
        """The outputs of ``req_id`` made visible so far (a copy): those of its result once
        it finished, else the tokens of the steps read so far.

        Raises:
            KeyError: an unknown request, or a finished one whose result was taken out of
                :attr:`results`.
        """
        if req_id in self.results:
            return list(self.results[req_id].output_token_ids)
        return list(self._outputs[req_id])

    def has_unfinished_requests(self) -> bool:
        """Requests running, waiting, in flight, or not arrived yet."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or len(self.pending) > 0

    def reset_stats(self) -> None:
        """Start every figure afresh (after warm-up requests): the engine's counters, the
        scheduler's (preemptions, peak blocks, prefix-cache, speculation and KV connector counters) and the
        runner's (stage timings, output waits, metadata builds, cascade decisions). Requests,
        caches and results are kept."""
        self.stats = EngineStats()
        sched, kv = self.scheduler, self.scheduler.kv_cache_manager
        sched.num_preemptions = 0
        for pool in kv.pools:
            pool.reset_peak()  # peaks restart from the blocks in use now
        if hasattr(kv, "stats"):  # prefix caching (PrefixCacheStats)
            kv.stats = type(kv.stats)()
        if sched.spec is not None:
            sched.spec.stats = type(sched.spec.stats)()
        for conn in (sched.kv_connector, getattr(self.runner, "kv_connector", None)):  # KV connector counters
            if conn is not None:
                conn.stats = type(conn.stats)()
        if sched.kv_loads is not None:
            sched.kv_loads.num_loaded = sched.kv_loads.num_failed = 0
        reset = getattr(self.runner, "reset_stats", None)
        if reset is not None:
            reset()

    def _admit_arrived(self) -> None:
        """Give the scheduler every pending request that has arrived; with nothing else to
        run (nothing waiting, running or in flight), idle until the next arrival first."""
        if not len(self.pending):
            return
        idle = not self.scheduler.has_unfinished_requests() and self._in_flight is None
        if idle:
            self.clock.sleep(self.pending.next_arrival() - self.clock.now())
        for p in self.pending.pop_arrived(self.clock.now()):
            self.scheduler.add_request(p.req_id, p.prompt_token_ids, p.sampling_params)

    def _mark_scheduled(self, out) -> None:
        now = None
        for new in out.scheduled_new_reqs:
            timing = self.timings.get(new.req_id)
            if timing is not None and timing.first_scheduled_time is None:
                now = self.clock.now() if now is None else now
                timing.first_scheduled_time = now

    def step(self) -> list[str]:
        """One schedule + execute + update. Returns the ids of requests finished this step.

        Asynchronously: schedule and launch the next step, then read and apply the one
        launched before it (the ids returned are those its outputs finished).

        Raises:
            StepFailed: with :attr:`survive_step_errors`, the step raised; the requests of
                every in-flight step are finished (results with the outputs they had, blocks
                freed) and the engine may step on.
        """
        self._admit_arrived()
        try:
            if self.async_scheduling:
                return self._step_async()
            out = self.scheduler.schedule()
            self._mark_scheduled(out)
            result = self.runner.execute_model(out)
            self.stats.num_steps += 1
            self.stats.num_scheduled_tokens += out.total_num_scheduled_tokens
            return self._apply(out, result)
        except Exception as exc:
            if not self.survive_step_errors:
                raise
            self._fail_in_flight(exc)

    def _fail_in_flight(self, exc: Exception):
        """A step raised: finish the requests of every in-flight step with the outputs they
        had (``step_failure.abandon_in_flight``) and raise :class:`StepFailed` naming them.
        An error of the scheduler itself, with no step in flight, is raised as it is."""
        if self._in_flight is not None:  # the runner holds one unread step: read and drop it
            try:
                self._in_flight[1].result()
            except Exception:
                pass
        self._in_flight = None
        held = getattr(getattr(self.runner, "compiler", None), "requests", None)  # ModelRunner's states
        failed = abandon_in_flight(self.scheduler, None if held is None else held.__contains__)
        if not failed:
            raise exc
        for rid in (r for r in failed if r in self._outputs):  # not those that finished before
            n = len(self.scheduler.get_request(rid).output_token_ids)
            outs = self._outputs.pop(rid)[:n]
            self.results[rid] = RequestResult(rid, self._prompts.pop(rid), outs,
                                              self._logits.pop(rid)[: len(outs)], self.timings.get(rid))
        raise StepFailed(failed, exc) from exc

    def _step_async(self) -> list[str]:
        prev, self._in_flight = self._in_flight, None
        if self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()  # planned while the previous step runs
            self._mark_scheduled(out)
            try:
                self._in_flight = (out, self.runner.execute_model_async(out))
            except Exception:
                self._in_flight = prev  # still unread: _fail_in_flight drains it
                raise
            self.stats.num_steps += 1
            self.stats.num_scheduled_tokens += out.total_num_scheduled_tokens
        if prev is None:
            return []
        prev_out, handle = prev
        return self._apply(prev_out, handle.result())  # the one wait per step

    def _apply(self, out, result) -> list[str]:
        """Feed one step's outputs to the scheduler; keep what it accepted."""
        before = {rid: self.scheduler.get_request(rid).num_output_tokens for rid in result.sampled_token_ids}
        kv = getattr(result, "kv_connector_output", None)  # a KV connector's loads that ended
        finished = (self.scheduler.update_from_output(out, result.sampled_token_ids) if kv is None
                    else self.scheduler.update_from_output(out, result.sampled_token_ids, kv))
        now = self.clock.now()  # when this step's tokens became visible
        for rid, toks in result.sampled_token_ids.items():
            accepted = self.scheduler.get_request(rid).num_output_tokens - before[rid]
            if accepted <= 0:
                continue  # finished in an earlier step (asynchronous: scheduled once more)
            timing = self.timings.get(rid)
            if timing is not None:
                timing.chunk_times.append(now)
                timing.chunk_tokens.append(accepted)
            self._outputs[rid].extend(toks[:accepted])
            self.stats.num_generated_tokens += accepted
            if rid in result.logits:  # [V], or [tokens, V] from a step that verified drafts
                lg = result.logits[rid]
                self._logits[rid].extend(lg[:accepted]) if lg.dim() == 2 else self._logits[rid].append(lg)
        for rid in finished:
            req = self.scheduler.get_request(rid)
            remote = req.output_token_ids[:req.kv_remote_tokens]  # sampled by a disaggregated prefill
            outs = (remote + self._outputs.pop(rid))[: len(req.output_token_ids)]
            self.results[rid] = RequestResult(rid, self._prompts.pop(rid), outs,
                                              self._logits.pop(rid)[: len(outs)], self.timings.get(rid))
        return finished

    def run(self, on_step: Callable[[list[str]], None] | None = None, max_steps: int | None = None) -> dict[str, RequestResult]:
        """Step until every request finishes (or ``max_steps``); ``on_step(finished)`` after each.

        Returns:
            ``{req_id: RequestResult}`` of every finished request.
        """
        import time

        t0 = time.perf_counter()
        while self.has_unfinished_requests():
            if max_steps is not None and self.stats.num_steps >= max_steps:
                break
            finished = self.step()
            if on_step is not None:
                on_step(finished)
        if self._in_flight is not None:  # stopped by max_steps with a step in flight
            prev_out, handle = self._in_flight
            self._in_flight = None
            self._apply(prev_out, handle.result())
        # The last finished ids reach the runner with the next schedule(); flush them so
        # the runner forgets those requests too.
        flush = self.scheduler.schedule()
        self.runner.execute_model(flush)
        self.scheduler.update_from_output(flush, {})
        self.stats.wall_time_s += time.perf_counter() - t0
        return self.results
