"""Preemption on request: the ``Scheduler.preempt`` test hook and ``force_preemption_every``."""

from __future__ import annotations

from attnplug.core.errors import SchedulingError
from attnplug.runner.serve.request import Request, RequestStatus


def preempt_running(sched, req_id: str) -> None:
    """Preempt a running request of ``sched`` (a ``Scheduler``) now, between steps (as if out of blocks).

    Raises:
        SchedulingError: the request is not running, or a step is in flight (call
            ``update_from_output`` first).
    """
    if sched._in_flight and not sched.config.async_scheduling:
        raise SchedulingError("preempt() during a step: call update_from_output() first")
    req = sched.requests.get(req_id)
    if req is None or req.status is not RequestStatus.RUNNING:
        status = None if req is None else req.status.value
        raise SchedulingError(f"cannot preempt {req_id!r}: status {status}, only running requests")
    sched._preempt(req)


def maybe_force_preemption(sched) -> Request | None:
    """``config.force_preemption_every`` = k: every k-th step, preempt the most recently admitted
    running request that has an output and was never preempted (``None`` when none is)."""
    every = sched.config.force_preemption_every
    if every is None or (sched.num_steps + 1) % every or len(sched.running) < 2:
        return None
    for req in reversed(sched.running):
        if req.num_output_tokens >= 1 and req.num_preemptions == 0:
            sched._preempt(req)
            return req
    return None
