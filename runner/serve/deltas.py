"""The deltas a scheduling decision becomes: one ``SchedulerOutput`` (vLLM V1's shape).

``scheduled_cached_reqs`` carry only what changed (new block ids, ``num_computed_tokens``
before the step; full replacement lists when resumed); ``scheduled_new_reqs`` the full
start state; ``num_scheduled_tokens`` lists cached requests first, then new ones, in
delta order (the order the step compiler's fast path expects).
"""

from __future__ import annotations

from attnplug.runner.serve.request import Request
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


def make_output(requests: dict[str, Request], sched: dict[str, int], new_blocks: dict[str, tuple[list[int], ...]],
                new_reqs: list[Request], resumed: list[Request], finished: set[str]) -> SchedulerOutput:
    """The step's ``SchedulerOutput`` from the scheduler's decisions.

    Args:
        requests: every request by id.
        sched: ``{req_id: tokens}`` of every scheduled request.
        new_blocks: per running request scheduled, its newly allocated block ids per group.
        new_reqs: requests the runner sees for the first time.
        resumed: requests coming back from preemption (their full block lists are sent).
        finished: ids finished since the previous step.
    """
    cached = CachedRequestData()

    def add_cached(req: Request, is_resumed: bool, blocks: tuple[list[int], ...] | None):
        cached.req_ids.append(req.req_id)
        cached.resumed_from_preemption.append(is_resumed)
        cached.new_token_ids.append([])
        cached.new_block_ids.append(blocks)
        cached.num_computed_tokens.append(req.num_computed_tokens)

    for req_id, blocks in new_blocks.items():
        add_cached(requests[req_id], False,
                   tuple(list(b) for b in blocks) if any(blocks) else None)
    for req in resumed:
        add_cached(req, True, tuple(list(b) for b in req.block_ids))
    new_data = [NewRequestData(req_id=r.req_id, prompt_token_ids=list(r.prompt_token_ids),
                               block_ids=tuple(list(b) for b in r.block_ids),
                               num_computed_tokens=r.num_computed_tokens,
                               sampling_params=r.sampling_params, prompt_embeds=r.prompt_embeds,
                               mm_features=r.mm_features,
                               output_token_ids=list(r.output_token_ids))
                for r in new_reqs]
    # Order num_scheduled_tokens like the deltas: cached (running, resumed), then new.
    order = [*cached.req_ids, *(r.req_id for r in new_reqs)]
    num_scheduled = {rid: sched[rid] for rid in order}
    return SchedulerOutput(scheduled_new_reqs=new_data, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=num_scheduled,
                           total_num_scheduled_tokens=sum(num_scheduled.values()),
                           finished_req_ids=finished)
