"""When a step raises: the scheduler forgets the steps in flight and finishes their requests.

A server (``runner/api/``) must survive an exception inside one step (a kernel error, a
bad value a backend refused): the requests of that step fail, the others go on. The
scheduler counted each in-flight step against its requests (``steps_in_flight``, and
with asynchronous scheduling placeholders and advanced ``num_computed_tokens``) and keeps
the step in its in-flight queue until ``update_from_output``, which will never come for
a step that raised. :func:`abandon_in_flight` undoes that count and finishes the step's
requests as an abort does (``Scheduler.abort_request``): their blocks go back to the
pools and their ids reach the runner in the next ``finished_req_ids``, so the runner
drops whatever state the failed step left for them.

A friend of :class:`~attnplug.runner.serve.scheduler.Scheduler` (it reads the scheduler's
in-flight queue), kept apart so that the scheduler's own module stays one concept.
"""

from __future__ import annotations

from typing import Callable

from attnplug.core.errors import AttnplugError


class StepFailed(AttnplugError):
    """A step raised; its requests were finished with the outputs they had.

    Attributes:
        req_ids: the requests of the failed step(s), in schedule order.
        cause: the exception the step raised.
    """

    def __init__(self, req_ids: list[str], cause: BaseException):
        self.req_ids = list(req_ids)
        self.cause = cause
        super().__init__(f"a step failed with {type(cause).__name__}: {' '.join(str(cause).split())[:300]}; "
                         f"its {len(req_ids)} request(s) were finished")


def abandon_in_flight(scheduler, runner_holds: Callable[[str], bool] | None = None) -> list[str]:
    """Drop every in-flight step of ``scheduler`` and finish its unfinished requests.

    Args:
        runner_holds: whether the runner holds a request's state. A request first scheduled
            in the failed step reached the runner only if the step got as far as applying
            its deltas; one the runner never held is left out of the next
            ``finished_req_ids`` (stage 1 refuses unknown ids). ``None``: assume it holds all.

    Returns:
        The ids of the requests those steps scheduled (each once, schedule order);
        ``[]`` when nothing was in flight.
    """
    failed: dict[str, None] = {}
    while scheduler._in_flight:
        out = scheduler._in_flight.popleft()
        sampling = scheduler._placeholders.pop(id(out), set())
        for req_id in out.num_scheduled_tokens:
            req = scheduler.requests[req_id]
            req.steps_in_flight -= 1
            if req_id in sampling:
                req.num_output_placeholders -= 1
            failed[req_id] = None
    for req_id in failed:
        req = scheduler.requests[req_id]
        if not req.is_finished:
            scheduler.abort_request(req_id)
        if req.free_when_idle and req.steps_in_flight == 0:
            req.free_when_idle = False
            scheduler.kv_cache_manager.free(req)
        if runner_holds is not None and not runner_holds(req_id):
            scheduler._finished_since_schedule.discard(req_id)
    return list(failed)
