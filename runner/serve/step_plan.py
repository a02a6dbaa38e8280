"""What one ``Scheduler.schedule()`` call has decided so far: the hand-off between its phases.

Data only. ``schedule`` fills it in two phases — the running requests
(``Scheduler._schedule_running``), then the waiting queue (``waiting_admission.admit_waiting``)
— and turns it into the step's ``SchedulerOutput`` (``deltas.make_output``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnplug.runner.serve.request import Request


@dataclass
class StepPlan:
    """One step's plan, filled while scheduling.

    Attributes:
        budget: tokens of ``max_num_batched_tokens`` not yet given to a request.
        sched: request id -> tokens scheduled this step (drafts included), in scheduling order.
        new_blocks: request id -> the new block ids of each cache group (a tuple of one list
            per group), for running requests; new and resumed ones carry theirs on the request.
        preempted: requests preempted this step (forced or for blocks), in order.
        spec_tokens: request id -> the draft token ids scheduled for verification.
        new_reqs: requests sent to the runner for the first time this step.
        resumed: preempted requests admitted again this step (their blocks replaced whole).
    """

    budget: int
    sched: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
