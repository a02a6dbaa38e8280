"""A long-running engine forgets its finished requests.

``Scheduler.requests`` keeps every request ever added (``attnplug run`` reads them after
the run). A server (``runner/api/``) would grow without bound, so it hands the ids it
is done with to :func:`forget_finished`, which drops each one once nothing can still
look it up: finished, no in-flight step scheduled it, and its id already went to the
runner in a ``finished_req_ids``. Ids of forgotten requests are not checked for reuse
any more; the server makes a new random id per request.
"""

from __future__ import annotations

from typing import Iterable


def forget_finished(scheduler, req_ids: Iterable[str]) -> list[str]:
    """Drop from ``scheduler.requests`` every id of ``req_ids`` that nothing needs any more.

    Returns:
        The ids still needed (unfinished, in flight, or not yet announced to the runner);
        pass them again later. Unknown ids are ignored.
    """
    keep = []
    for rid in req_ids:
        req = scheduler.requests.get(rid)
        if req is None:
            continue
        if req.is_finished and req.steps_in_flight == 0 and rid not in scheduler._finished_since_schedule:
            del scheduler.requests[rid]
        else:
            keep.append(rid)
    return keep
