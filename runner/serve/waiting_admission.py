"""The second phase of ``Scheduler.schedule()``: admitting waiting requests, first come first served.

A request is admitted while the budget, ``max_num_seqs`` (requests whose KV is loading count)
and the block pools allow; the first one that does not fit stops the queue (FIFO, no
overtaking). Per request: a KV connector load that has ended is admitted as loaded
(``RemoteKVLoads.admit_loaded``); otherwise the local prefix-cache hit is looked up, then the
connector (``RemoteKVLoads.lookup``): a request it holds more of starts loading and computes
nothing yet; else the request is admitted with its hit, its first chunk aligned by the cache
manager (Mamba checkpoints), new or resumed.
"""

from __future__ import annotations

from attnplug.runner.serve.request import RequestStatus
from attnplug.runner.serve.step_plan import StepPlan


def admit_waiting(sched, plan: StepPlan) -> None:
    """Admit from ``sched.waiting`` into ``plan`` (and ``sched.running``), FIFO, until one does
    not fit. ``sched`` is the ``Scheduler``; nothing is admitted past a request whose old
    blocks are still in use by the step in flight (``free_when_idle``)."""
    cfg, kvm, loads = sched.config, sched.kv_cache_manager, sched.kv_loads
    loading = len(loads) if loads is not None else 0
    while sched.waiting and plan.budget > 0 and len(sched.running) + loading < cfg.max_num_seqs:
        req = sched.waiting[0]
        if req.free_when_idle:
            break  # its old blocks are still in use by the step in flight
        if req.kv_load is not None and not req.sent_to_runner and req.status is RequestStatus.WAITING:
            if (n := loads.admit_loaded(req, plan.budget, bool(plan.sched))) is None:  # load ended
                break
            plan.new_reqs.append(req)
            plan.sched[req.req_id] = n
            plan.budget -= n
            continue
        hit = kvm.get_computed_blocks(req)  # prefix caching (NO_HIT without)
        ext = loads.lookup(req, hit.num_computed_tokens) if loads is not None else 0
        if ext:  # the connector holds more: load it first, compute nothing yet
            if not loads.start(req, hit, ext):
                break
            loading += 1
            continue
        total = req.num_tokens_to_compute - hit.num_computed_tokens
        if not cfg.enable_chunked_prefill and not req.sent_to_runner and total > plan.budget:
            break
        n = kvm.align_num_new_tokens(req, hit.num_computed_tokens, min(total, plan.budget))
        if sched._allocate(req, n, hit) is None:
            break
        req.num_computed_tokens = hit.num_computed_tokens
        kvm.record_admission(req, hit)
        sched.waiting.popleft()
        sched.running.append(req)
        req.status = RequestStatus.RUNNING
        (plan.resumed if req.sent_to_runner else plan.new_reqs).append(req)
        req.sent_to_runner = True
        plan.sched[req.req_id] = n
        plan.budget -= n
