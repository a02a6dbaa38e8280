"""Rank 0's runner wrapper and the other ranks' serve loop.

Rank 0 keeps the scheduler: :class:`ParallelRunner` wraps its ``ModelRunner`` and, before
each step, sends the step's ``SchedulerOutput`` over the :class:`Channel`; then every rank
runs the same step on its own ``ModelRunner`` (its own ``StepCompiler``, its own caches), the
model's collectives meeting inside the forward. Every rank gathers the full logits and
samples the same tokens (docs/distributed.md, "Sampling"), so each token history stays
identical with nothing sent back.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from attnplug.core import switches
from attnplug.runner.parallel.channel import (BUILD, ERROR, EXIT, KIND_NAMES, STEP, STEP_ASYNC, Channel,
                                             SourceFailedError)
from attnplug.runner.parallel.state import ParallelState, current
from attnplug.runner.parallel.validate import MetadataIdentityCheck


def validate_enabled() -> bool:
    return switches.flag("ATTNPLUG_VALIDATE")


def attach(runner: Any, state: ParallelState) -> None:
    """Give a rank's ``ModelRunner`` the cross-rank metadata check (``ATTNPLUG_VALIDATE=1``)."""
    if validate_enabled():
        runner.on_common_metadata = MetadataIdentityCheck(state)


class ParallelRunner:
    """Rank 0's ``ModelRunner``: each step is first broadcast, then run here.

    Everything else is the wrapped runner's (attribute access is forwarded).
    :meth:`median_stage_us` adds ``broadcast`` (sending the step) and ``collectives`` (the
    model's all-reduces and the logits all-gather, inside ``forward`` and ``sample``).
    """

    def __init__(self, runner: Any, channel: Channel):
        self.runner, self.channel = runner, channel
        attach(runner, channel.state)
        self.broadcast_ns: list[int] = []
        self.collective_ns: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _send(self, kind: int, out) -> None:
        t0 = time.perf_counter_ns()
        self.channel.exchange((kind, out))
        self.broadcast_ns.append(time.perf_counter_ns() - t0)
        self.channel.state.timer.take()

    def _collectives(self) -> None:
        self.collective_ns.append(self.channel.state.timer.take()[0])

    def execute_model(self, scheduler_output):
        self._send(STEP, scheduler_output)
        out = self.runner.execute_model(scheduler_output)
        self._collectives()
        return out

    def execute_model_async(self, scheduler_output):
        self._send(STEP_ASYNC, scheduler_output)
        out = self.runner.execute_model_async(scheduler_output)
        self._collectives()
        return out

    def median_stage_us(self) -> dict[str, float]:
        stages = self.runner.median_stage_us()
        for name, v in (("broadcast", self.broadcast_ns), ("collectives", self.collective_ns)):
            stages[name] = float(np.median(v)) / 1e3 if v else 0.0
        return stages


def wrap_runner(runner: Any, alone: bool = False) -> Any:
    """``runner`` itself outside a distributed run and on ranks other than 0; on rank 0, tell
    the other ranks to build their engine (``alone``: the batch-of-one engine of ``attnplug
    run``'s invariance check) and return the :class:`ParallelRunner` around ``runner``."""
    state = current()
    if state is None or state.rank != 0 or state.channel is None:
        return runner
    state.channel.exchange((BUILD, alone))
    return ParallelRunner(runner, state.channel)


def serve(channel: Channel, build: Callable[[bool], Any],
          on_output: Callable[[Any], Any] | None = None) -> int:
    """A rank other than 0: run rank 0's commands until :data:`EXIT` (returns 0) or
    :data:`ERROR` (raises :class:`SourceFailedError` with rank 0's failure line).

    Args:
        channel: the rank's channel.
        build: ``build(alone) -> ModelRunner`` for a :data:`BUILD` command (the same options
            rank 0 built its engine with).
        on_output: applied to each received ``SchedulerOutput`` before it runs (tests use it
            to feed a rank a different step).

    Raises:
        SourceFailedError: rank 0 failed between commands and said so.
        whatever a step raises (the caller reports it with the rank).
    """
    runner, pending = None, []
    while True:
        kind, payload = channel.exchange(None)
        if kind == BUILD:
            runner, pending = build(bool(payload)), []
            attach(runner, channel.state)
        elif kind in (STEP, STEP_ASYNC):
            if runner is None:
                raise RuntimeError(f"{KIND_NAMES[kind]} before any BUILD")
            out = on_output(payload) if on_output else payload
            if kind == STEP:
                while pending:  # rank 0 read every in-flight result before a synchronous step
                    pending.pop(0).result()
                runner.execute_model(out)
            else:  # rank 0 launches step t + 1, then reads step t
                pending.append(runner.execute_model_async(out))
                if len(pending) == 2:
                    pending.pop(0).result()
        elif kind == EXIT:
            return 0
        elif kind == ERROR:
            raise SourceFailedError(payload)
