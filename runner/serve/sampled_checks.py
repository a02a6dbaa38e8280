"""The checks of a step's sampled tokens before ``Scheduler.update_from_output`` changes anything."""

from __future__ import annotations

from attnplug.core.errors import SchedulingError


def check_sampled_tokens(requests: dict, scheduled: dict[str, int], sampling: set[str] | None,
                         sampled_token_ids: dict[str, list[int]]) -> None:
    """Every complete request of the step has sampled tokens, no partial prefill or
    unscheduled request has any, and no list is empty.

    Args:
        requests: ``{req_id: Request}``.
        scheduled: the step's ``num_scheduled_tokens``.
        sampling: asynchronous scheduling: the requests that sample in the step (``None``:
            synchronous, a request is complete when its scheduled tokens reach ``num_tokens``).
        sampled_token_ids: what the runner sampled.

    Raises:
        SchedulingError: the first violation, naming the request.
    """
    for req_id, toks in sampled_token_ids.items():
        if req_id not in scheduled:
            raise SchedulingError(f"sampled tokens for {req_id!r}, which was not scheduled this step")
        if not toks:
            raise SchedulingError(f"empty sampled token list for {req_id!r}; omit the key instead")
    for req_id, n in scheduled.items():
        req = requests[req_id]
        complete = req_id in sampling if sampling is not None else req.num_computed_tokens + n >= req.num_tokens
        if complete and req_id not in sampled_token_ids:
            raise SchedulingError(
                f"{req_id!r} computed all its {req.num_tokens} tokens this step but no sampled "
                "token was given; pass its sample (only partial prefills are discarded)")
        if not complete and req_id in sampled_token_ids:
            raise SchedulingError(
                f"{req_id!r} is a partial prefill ({req.num_computed_tokens + n} of "
                f"{req.num_tokens} tokens); its sampled tokens must be discarded")
