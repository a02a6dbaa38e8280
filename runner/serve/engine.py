"""The engine loop: schedule → ``ModelRunner.execute_model`` → feed tokens back.

Partial prefills (and recomputes after preemption) produce no visible token: the runner
drops their rows, and the scheduler only advances their ``num_computed_tokens``.

With ``SchedulerConfig.async_scheduling`` one step is in flight: each ``step()`` schedules
and launches step t + 1 (its decode rows read step t's tokens on the device), then waits
for step t's outputs — the one wait per step, ``AsyncModelRunnerOutput.result()`` — and
feeds them to the scheduler, which corrects its optimistic plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from attnplug.runner.execute.model_runner import ModelRunner
from attnplug.runner.serve.scheduler import Scheduler
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
    """A finished request: its prompt, outputs, and (when recorded) per-output logits."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)


class LLMEngine:
    """Drives a scheduler and a model runner until every request finishes.

    Args:
        scheduler: emits one ``SchedulerOutput`` per step.
        runner: executes it.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.stats = EngineStats()
        self._prompts: dict[str, list[int]] = {}
        self._outputs: dict[str, list[int]] = {}
        self._logits: dict[str, list[torch.Tensor]] = {}
        self.results: dict[str, RequestResult] = {}
        self.async_scheduling = bool(scheduler.config.async_scheduling)
        self._in_flight: tuple | None = None
        """Asynchronous scheduling: ``(SchedulerOutput, AsyncModelRunnerOutput)`` of the step
        launched last, whose outputs are not read yet."""

    def add_request(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Queue a request (validated by the scheduler; a rejected one changes nothing)."""
        self.scheduler.add_request(req_id, prompt_token_ids, sampling_params)
        self._prompts[req_id] = list(prompt_token_ids)
        self._outputs[req_id] = []
        self._logits[req_id] = []
        self.stats.num_prompt_tokens += len(prompt_token_ids)

    def abort_request(self, req_id: str) -> None:
        """Stop a request now (``Scheduler.abort_request``); its result keeps the outputs it
        had. With a step in flight, that step's sample for it is dropped.

        Raises:
            SchedulingError: an unknown or finished request.
        """
        self.scheduler.abort_request(req_id)
        req = self.scheduler.get_request(req_id)
        outs = self._outputs.pop(req_id)[: len(req.output_token_ids)]
        self.results[req_id] = RequestResult(req_id, self._prompts.pop(req_id), outs,
                                             self._logits.pop(req_id)[: len(outs)])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[str]:
        """One schedule + execute + update. Returns the ids of requests finished this step.

        Asynchronously: schedule and launch the next step, then read and apply the one
        launched before it (the ids returned are those its outputs finished)."""
        if self.async_scheduling:
            return self._step_async()
        out = self.scheduler.schedule()
        result = self.runner.execute_model(out)
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += out.total_num_scheduled_tokens
        return self._apply(out, result)

    def _step_async(self) -> list[str]:
        prev, self._in_flight = self._in_flight, None
        if self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()  # planned while the previous step runs
            self._in_flight = (out, self.runner.execute_model_async(out))
            self.stats.num_steps += 1
            self.stats.num_scheduled_tokens += out.total_num_scheduled_tokens
        if prev is None:
            return []
        prev_out, handle = prev
        return self._apply(prev_out, handle.result())  # the one wait per step

    def _apply(self, out, result) -> list[str]:
        """Feed one step's outputs to the scheduler; keep what it accepted."""
        before = {rid: self.scheduler.get_request(rid).num_output_tokens for rid in result.sampled_token_ids}
        finished = self.scheduler.update_from_output(out, result.sampled_token_ids)
        for rid, toks in result.sampled_token_ids.items():
            accepted = self.scheduler.get_request(rid).num_output_tokens - before[rid]
            if accepted <= 0:
                continue  # finished in an earlier step (asynchronous: scheduled once more)
            self._outputs[rid].extend(toks[:accepted])
            self.stats.num_generated_tokens += accepted
            if rid in result.logits:  # [V], or [tokens, V] from a step that verified drafts
                lg = result.logits[rid]
                self._logits[rid].extend(lg[:accepted]) if lg.dim() == 2 else self._logits[rid].append(lg)
        for rid in finished:
            req = self.scheduler.get_request(rid)
            outs = self._outputs.pop(rid)[: len(req.output_token_ids)]
            self.results[rid] = RequestResult(rid, self._prompts.pop(rid), outs,
                                              self._logits.pop(rid)[: len(outs)])
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
