"""Continuous batching: decide each step which requests compute how many tokens.

The :class:`Scheduler` keeps waiting and running queues, a token budget
(``max_num_batched_tokens``), a cap on running requests (``max_num_seqs``) and one block
pool per cache group (``attnplug.cache_groups.block_pool``). Each ``schedule()`` emits
exactly the deltas of ``attnplug.runner.step.scheduler_output``; ``update_from_output`` feeds
the step's sampled tokens back. Semantics follow vLLM V1's scheduler (prefix caching:
``kv_cache_manager.py``; speculative decoding: ``spec_schedule.py``):

* A request computes ``num_tokens - num_computed_tokens`` tokens (prompt plus outputs
  minus what is cached), capped by what is left of the budget (chunked prefill). After
  its last prompt chunk it computes one token a step (decode).
* Order each step: running decodes, then running prefills (both in admission order),
  then waiting requests FIFO while the budget, ``max_num_seqs`` and the pools allow.
* When a running request's blocks cannot be allocated, the most recently admitted running
  request is preempted by recompute: its blocks are freed, ``num_computed_tokens`` reset
  to 0, and it goes to the front of the waiting queue. No waiting request is admitted in a
  step that preempted (unless the step would otherwise be empty). When scheduled again
  it is sent as a cached request with ``resumed_from_preemption=True``, replacement block
  ids and ``num_computed_tokens == 0``; the runner kept its token history and recomputes
  prompt plus generated tokens (chunked if needed, even with chunked prefill disabled).
* A request finishes at ``sampling_params.max_tokens`` outputs or ``max_model_len`` tokens;
  its blocks are freed at once and its id is sent in the next step's ``finished_req_ids``.
* With a KV connector (``core/kv_connector.py``), a waiting request whose prefix the
  connector holds beyond the local hit loads first, without compute (``kv_loads.py``).
"""

from __future__ import annotations

from collections import deque

from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.core.errors import SchedulingError
from attnplug.core.kv_connector import KVConnectorBase, KVConnectorOutput
from attnplug.runner.serve.admission import check_new_request
from attnplug.runner.serve.deltas import make_output
from attnplug.runner.serve.kv_cache_manager import make_kv_cache_manager
from attnplug.runner.serve.kv_loads import RemoteKVLoads
from attnplug.runner.serve.preemption import maybe_force_preemption, preempt_running
from attnplug.runner.serve.request import Request, RequestStatus
from attnplug.runner.serve.sampled_checks import check_sampled_tokens
from attnplug.runner.serve.scheduler_config import SchedulerConfig
from attnplug.runner.serve.spec_schedule import SpecScheduler, make_spec_scheduler
from attnplug.runner.serve.step_plan import StepPlan
from attnplug.runner.serve.waiting_admission import admit_waiting
from attnplug.runner.step.kernels import kernels_available
from attnplug.runner.step.packed_deltas import draft_tokens, pack_cached_deltas
from attnplug.runner.step.scheduler_output import SamplingParams, SchedulerOutput

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler:
    """Continuous-batching scheduler with chunked prefill and preemption by recompute.

    Args:
        config: the step limits.
        kv_cache_config: the cache groups; one block pool of ``num_blocks`` per group.
        kv_connector: the scheduler-side KV connector (``core/kv_connector.py``), or ``None``.

    Raises:
        KVCacheSpecError: a group's spec has no block policy.
        ConfigError: a KV connector with asynchronous scheduling (not supported).

    Examples:
        >>> from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
        >>> from attnplug.cache_groups.specs import FullAttentionSpec
        >>> kv = KVCacheConfig(16, (KVCacheGroupSpec(("l0",), FullAttentionSpec(block_size=4)),))
        >>> s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=64), kv)
        >>> s.add_request("a", list(range(10)), SamplingParams(max_tokens=2))
        >>> out = s.schedule(); out.num_scheduled_tokens, out.scheduled_new_reqs[0].block_ids
        ({'a': 8}, ([1, 2],))
        >>> s.update_from_output(out, {})   # partial prefill: nothing sampled
        []
    """

    def __init__(self, config: SchedulerConfig, kv_cache_config: KVCacheConfig,
                 kv_connector: KVConnectorBase | None = None):
        self.config = config
        self.kv_cache_manager = make_kv_cache_manager(kv_cache_config, config)
        self.requests: dict[str, Request] = {}
        """Every request ever added, finished ones included (see ``get_request``)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Admitted requests in admission order (the last one is preempted first)."""
        self.num_steps = 0
        self.num_preemptions = 0
        self._next_arrival = 0
        self._finished_since_schedule: set[str] = set()
        self._in_flight: deque[SchedulerOutput] = deque()
        """Scheduled steps whose ``update_from_output`` has not come yet, oldest first: at
        most one, or two with ``config.async_scheduling``."""
        self._placeholders: dict[int, set[str]] = {}
        """Asynchronous scheduling: per in-flight output (``id``), the requests that sample in it."""
        self.spec: SpecScheduler | None = make_spec_scheduler(config, kv_cache_config)
        """Speculative decoding (``config.speculative``): drafts and rollback, ``spec_schedule.py``."""
        self._packed = kernels_available() if config.packed_deltas is None else config.packed_deltas
        """Send drafts and block appends as ``PackedCachedDeltas`` (``config.packed_deltas``;
        ``None``: when the compiled step kernels are built). Never with a KV connector."""
        self.kv_connector = kv_connector
        self.kv_loads: RemoteKVLoads | None = RemoteKVLoads(self, kv_connector) if kv_connector is not None else None
        """Requests whose KV is loading through the connector (``kv_loads.py``)."""

    # --- requests -----------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    prompt_embeds=None, mm_features=None) -> None:
        """Queue a request (FIFO). Validates first; a rejected request changes nothing.

        Args:
            req_id: a new, unique id (ids of finished requests are not reused).
            prompt_token_ids: the prompt's token ids, ``1 <= len < max_model_len``.
            sampling_params: defaults to ``SamplingParams()``; ``max_tokens >= 1``.
            prompt_embeds, mm_features: ``None`` or ``Request``'s (``LLMEngine.add_request`` checks them).

        Raises:
            InvalidRequestError: duplicate id, empty or too long prompt, negative token id,
                ``max_tokens < 1``, a prompt that can never be scheduled (longer than the budget
                with chunked prefill off) or a request that cannot fit in some group's pool alone.
        """
        sp = SamplingParams() if sampling_params is None else sampling_params
        prompt = check_new_request(self.config, self.kv_cache_manager, self.requests, req_id, prompt_token_ids, sp)
        req = Request(req_id, prompt, sp, arrival_index=self._next_arrival, prompt_embeds=prompt_embeds,
                      mm_features=mm_features or None, block_ids=tuple([] for _ in range(self.kv_cache_manager.num_groups)))
        self._next_arrival += 1
        self.requests[req_id] = req
        self.waiting.append(req)

    def abort_request(self, req_id: str) -> None:
        """Finish a request now, whatever its state (a client went away).

        Its blocks are freed once no in-flight step uses them; an in-flight step's sample
        for it is dropped; its id goes to the runner in the next ``finished_req_ids``.

        Raises:
            SchedulingError: an unknown or already finished request.
        """
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            raise SchedulingError(f"cannot abort {req_id!r}: {'unknown' if req is None else 'already finished'}")
        known_to_runner = req.sent_to_runner
        self._finish(req)
        if not known_to_runner:
            self._finished_since_schedule.discard(req_id)  # never reached the runner

    def get_request(self, req_id: str) -> Request:
        """The request (finished ones included). Raises KeyError for an unknown id."""
        return self.requests[req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.kv_loads)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + (len(self.kv_loads) if self.kv_loads is not None else 0)

    @property
    def peak_blocks_per_group(self) -> list[int]:
        """Per cache group, the most blocks owned by requests at once so far."""
        return self.kv_cache_manager.peak_blocks_per_group

    # --- preemption ---------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        """Free the request's blocks now, or once no in-flight step uses them."""
        if req.steps_in_flight:
            req.free_when_idle = True
        else:
            self.kv_cache_manager.free(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.block_ids = tuple([] for _ in range(self.kv_cache_manager.num_groups))
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def preempt(self, req_id: str) -> None:
        """Test hook: preempt a running request now, between steps (``preemption.preempt_running``)."""
        preempt_running(self, req_id)

    # --- one step -----------------------------------------------------------------------
    def _allocate(self, req: Request, n: int, hit=None) -> tuple[list[int], ...] | None:
        new = self.kv_cache_manager.allocate_slots(req, n, hit)
        if new is not None:
            req.block_ids = self.kv_cache_manager.get_block_ids(req.req_id)
        return new

    def schedule(self) -> SchedulerOutput:
        """Plan one step and return its deltas.

        Returns:
            The step's ``SchedulerOutput``: first-time requests in ``scheduled_new_reqs``
            (full prompt, initial block ids per group, ``num_computed_tokens == 0``);
            resident ones in ``scheduled_cached_reqs`` (new block ids per group, ``None``
            when none; full replacement ids when resumed; ``num_computed_tokens`` before
            this step; ``new_token_ids`` empty because the runner appends its own samples);
            ``num_scheduled_tokens`` with ``total <= max_num_batched_tokens``; and the
            ids finished since the previous ``schedule()``.

        With ``config.async_scheduling`` one step may be in flight: this step is planned as
        if each of its requests that samples had its token (a placeholder, counted in
        ``num_tokens``); ``update_from_output`` then corrects it.

        Raises:
            SchedulingError: the previous step's ``update_from_output`` was not called (with
                asynchronous scheduling: the one before it).
        """
        if len(self._in_flight) >= (2 if self.config.async_scheduling else 1):
            raise SchedulingError(
                "schedule() called again before update_from_output() of the previous step")
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        forced = maybe_force_preemption(self)
        if forced is not None:
            plan.preempted.append(forced)
        self._schedule_running(plan)
        if not plan.preempted or not plan.sched:  # no admission after a preemption unless the step is empty
            admit_waiting(self, plan)
        finished, self._finished_since_schedule = self._finished_since_schedule, set()
        out = make_output(self.requests, plan.sched, plan.new_blocks, plan.new_reqs, plan.resumed, finished)
        out.mamba_state_copies = self.kv_cache_manager.plan_state_copies(plan.sched, self.requests)
        if self._packed and self.kv_connector is None:  # PackedCachedDeltas
            out.scheduled_cached_reqs, out.packed_cached = pack_cached_deltas(
                out.scheduled_cached_reqs, plan.spec_tokens, self.kv_cache_manager.num_groups, copy=False)
        else:
            out.scheduled_spec_decode_tokens = plan.spec_tokens
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        self.num_steps += 1
        if plan.sched:
            self._launch(out)
        return out

    def _schedule_running(self, plan: StepPlan) -> None:
        """The first phase: running requests, decodes first, then unfinished prefills
        (admission order each), each with its drafts; a request whose blocks do not fit
        preempts the last running one (taken back from ``plan`` if already scheduled)."""
        cfg = self.config
        order = ([r for r in self.running if r.num_tokens_to_compute <= 1]
                 + [r for r in self.running if r.num_tokens_to_compute > 1])
        for req in order:
            if plan.budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if req.num_tokens_to_compute == 0 or req.remaining_output_tokens(cfg.max_model_len) == 0:
                continue  # asynchronous: its last output is in flight
            drafts = self.spec.propose(req, plan.budget) if self.spec is not None else []
            n = self.kv_cache_manager.align_num_new_tokens(
                req, req.num_computed_tokens, min(req.num_tokens_to_compute + len(drafts), plan.budget))
            assert n > 0, f"running request {req.req_id} has nothing to compute"
            drafts = drafts[:n - 1]  # a Mamba checkpoint boundary may cut the row: fewer drafts
            while (blocks := self._allocate(req, n)) is None:
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim.req_id in plan.sched:  # already scheduled this step: take it back
                    plan.budget += plan.sched.pop(victim.req_id)
                    del plan.new_blocks[victim.req_id]
                    plan.spec_tokens.pop(victim.req_id, None)
                if victim is req or victim.free_when_idle:
                    break  # (a victim in flight frees its blocks only after that step)
            if blocks is None:
                continue
            plan.sched[req.req_id] = n
            plan.new_blocks[req.req_id] = blocks
            plan.budget -= n
            if drafts:
                plan.spec_tokens[req.req_id] = drafts

    def _launch(self, out: SchedulerOutput) -> None:
        """The step goes in flight: count it against its requests; asynchronously, advance
        them now and give each one that samples a placeholder output."""
        self._in_flight.append(out)
        sampling: set[str] = set()
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            req.steps_in_flight += 1
            if self.config.async_scheduling:
                req.num_computed_tokens += n
                if req.num_computed_tokens >= req.num_tokens:
                    req.num_output_placeholders += 1
                    sampling.add(req_id)
        self._placeholders[id(out)] = sampling

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]],
                           kv_connector_output: KVConnectorOutput | None = None) -> list[str]:
        """Advance the step's requests and take their sampled tokens.

        Every scheduled request advances ``num_computed_tokens`` by its scheduled count
        (asynchronously: it did at ``schedule()``). A request whose scheduled tokens reached
        its full length must get sampled tokens; a partial prefill must not (the engine
        discards those). Tokens beyond what the request may still produce, and tokens of a
        request that finished in an earlier step (asynchronous: it was scheduled once more
        before its finish was known), are dropped. A request finishes at ``max_tokens``
        outputs, at ``max_model_len``, or on a stop token.

        Args:
            scheduler_output: the oldest in-flight ``schedule()`` output.
            sampled_token_ids: ``{req_id: [token ids]}`` (usually one token) for the
                non-discarded requests of the step.
            kv_connector_output: the worker's connector loads that ended in the step
                (``ModelRunnerOutput.kv_connector_output``), or ``None``.

        Returns:
            Ids of the requests that finished this step (blocks freed once no in-flight
            step uses them; the ids go out in the next ``schedule()``'s ``finished_req_ids``).

        Raises:
            SchedulingError: not the oldest in-flight output, or sampled tokens missing for
                a complete request / given for a partial prefill or an unscheduled request;
                nothing changes.
        """
        if not self._in_flight or scheduler_output is not self._in_flight[0]:
            if not scheduler_output.num_scheduled_tokens and not sampled_token_ids:
                if self.kv_loads is not None:
                    self.kv_loads.finish(kv_connector_output)  # a step that only loaded
                return []  # an empty step needs no update
            raise SchedulingError(
                "update_from_output() got a SchedulerOutput that is not the oldest in-flight schedule()'s "
                "(or was already applied); pass each step's output exactly once, in order")
        scheduled = scheduler_output.num_scheduled_tokens
        sampling = self._placeholders[id(scheduler_output)] if self.config.async_scheduling else None
        check_sampled_tokens(self.requests, scheduled, sampling, sampled_token_ids)
        drafts = draft_tokens(scheduler_output) if self.spec is not None else None
        if self.spec is not None:
            self.spec.check_sampled(drafts, sampled_token_ids)
        self._in_flight.popleft()
        del self._placeholders[id(scheduler_output)]
        if self.kv_loads is not None:
            self.kv_loads.finish(kv_connector_output)
        self.kv_cache_manager.finish_step()  # prefix caching: Mamba checkpoints of the step
        finished: list[str] = []
        for req_id, n in scheduled.items():
            req = self.requests[req_id]
            req.steps_in_flight -= 1
            if sampling is None:  # speculative decoding: minus the rejected drafts
                req.num_computed_tokens += n if self.spec is None else self.spec.computed_advance(
                    drafts, req_id, n, sampled_token_ids.get(req_id))
            elif req_id in sampling:
                req.num_output_placeholders -= 1
            if not req.is_finished and not req.free_when_idle:
                self.kv_cache_manager.cache_blocks(req)  # prefix caching: blocks now full
            toks = sampled_token_ids.get(req_id)
            if toks and not req.is_finished and self._accept(req, toks):
                self._finish(req)
                finished.append(req_id)
            if req.free_when_idle and req.steps_in_flight == 0:
                req.free_when_idle = False
                self.kv_cache_manager.free(req)
        return finished

    def _accept(self, req: Request, toks: list[int]) -> bool:
        """Append what ``req`` may still produce of ``toks``; whether it is now finished."""
        max_len = self.config.max_model_len
        for t in toks[:req.remaining_output_tokens(max_len)]:
            req.output_token_ids.append(int(t))
            if int(t) in req.sampling_params.stop_token_ids:
                req.stopped = True
                break
        return req.remaining_output_tokens(max_len) == 0 and req.num_output_placeholders == 0 or req.stopped

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)  # preempted while its last step was in flight, or aborted
        if self.kv_loads is None or not self.kv_loads.on_finish(req):  # loading: blocks held until it ends
            self._release(req)
        req.block_ids = tuple([] for _ in range(self.kv_cache_manager.num_groups))
        req.status = RequestStatus.FINISHED
        req.sent_to_runner = False
        self._finished_since_schedule.add(req.req_id)
