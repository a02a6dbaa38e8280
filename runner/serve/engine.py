"""The engine loop: schedule → ``ModelRunner.execute_model`` → feed tokens back.

Partial prefills (and recomputes after preemption) produce no visible token: the runner
drops their rows, and the scheduler only advances their ``num_computed_tokens``.
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

    def add_request(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Queue a request (validated by the scheduler; a rejected one changes nothing)."""
        self.scheduler.add_request(req_id, prompt_token_ids, sampling_params)
        self._prompts[req_id] = list(prompt_token_ids)
        self._outputs[req_id] = []
        self._logits[req_id] = []
        self.stats.num_prompt_tokens += len(prompt_token_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[str]:
        """One schedule + execute + update. Returns the ids of requests finished this step."""
        out = self.scheduler.schedule()
        result = self.runner.execute_model(out)
        finished = self.scheduler.update_from_output(out, result.sampled_token_ids)
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += out.total_num_scheduled_tokens
        for rid, toks in result.sampled_token_ids.items():
            self._outputs[rid].extend(toks)
            self.stats.num_generated_tokens += len(toks)
            if rid in result.logits:
                self._logits[rid].append(result.logits[rid])
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
        # The last finished ids reach the runner with the next schedule(); flush them so
        # the runner forgets those requests too.
        flush = self.scheduler.schedule()
        self.runner.execute_model(flush)
        self.scheduler.update_from_output(flush, {})
        self.stats.wall_time_s += time.perf_counter() - t0
        return self.results
