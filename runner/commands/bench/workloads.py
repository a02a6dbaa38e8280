"""Step workloads for ``attnplug bench step``: pre-recorded ``SchedulerOutput`` sequences.

* :func:`steady_decode` — N live requests, one token each per step; each step
  ``k = max(1, N // 64)`` of the oldest finish and ``k`` new ones arrive whose prompt is
  cached except its last token (``num_computed_tokens = L - 1``), prompt lengths cycling
  through :data:`PROMPT_LENGTHS`; block size 16; two cache groups with their own pools.
* :func:`trace_replay` — the bundled Azure conversation trace (CC-BY 4.0, Patel et al.,
  ISCA 2024; see ``runner/data/README.md``) through the real ``Scheduler`` with chunked
  prefill under a 2048-token budget, two cache groups (full attention + sliding window).

Both return a :class:`Workload`: the compiler configuration and the steps, so the
optimized and the naive step compilers replay exactly the same inputs.
"""

from __future__ import annotations

from collections import deque
from itertools import count
from dataclasses import dataclass, field

import numpy as np

from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

PROMPT_LENGTHS = (37, 128, 300, 511, 777, 1000, 1500, 2048, 2500, 3000)
"""Prompt lengths (tokens) of arriving requests in the steady-decode workload, cycled."""


@dataclass
class Workload:
    """A replayable step sequence.

    Attributes:
        name: label for the table.
        config: keyword arguments of ``StepCompiler`` / ``NaiveStepCompiler``.
        steps: the scheduler outputs, in order.
        num_warmup: leading steps not timed (filling the batch).
    """

    name: str
    config: dict
    steps: list[SchedulerOutput] = field(default_factory=list)
    num_warmup: int = 0


def steady_decode(num_reqs: int, num_steps: int, num_groups: int = 2, block_size: int = 16,
                  max_model_len: int = 8192, seed: int = 0, prompt_arrays: bool = False,
                  arrivals: bool = True) -> Workload:
    """The steady-decode workload with ``num_reqs`` live requests (see module docstring).

    Step 0 admits all ``num_reqs`` requests (warm-up, not timed); ``num_steps`` steady
    steps follow. Prompts are Python lists of ints (as vLLM's scheduler sends them), or
    ``int32`` numpy arrays with ``prompt_arrays`` (isolates the list → int32 conversion).
    ``arrivals=False``: nobody finishes or arrives after step 0 (pure decode: rows never move).
    """
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 32000, size=L, dtype=np.int32) for L in PROMPT_LENGTHS]
    if not prompt_arrays:
        prompts = [p.tolist() for p in prompts]
    k = max(1, num_reqs // 64) if arrivals else 0
    free = [count(1) for _ in range(num_groups)]  # finished blocks are never reused here
    live: deque[str] = deque()
    info: dict[str, list] = {}  # req_id -> [num_computed_tokens, num_blocks]
    next_id = 0

    def admit(n_new: int) -> list[NewRequestData]:
        nonlocal next_id
        out = []
        for _ in range(n_new):
            rid = f"req-{next_id}"
            p = prompts[next_id % len(prompts)]
            next_id += 1
            nb = -(-len(p) // block_size)
            blocks = tuple([next(free[g]) for _ in range(nb)] for g in range(num_groups))
            out.append(NewRequestData(rid, p, blocks, len(p) - 1))
            live.append(rid)
            info[rid] = [len(p) - 1, nb]
        return out

    steps = []
    new = admit(num_reqs)
    steps.append(SchedulerOutput(new, CachedRequestData(), {r.req_id: 1 for r in new}))
    for _ in range(num_steps):
        finished = set()
        for _ in range(k):
            rid = live.popleft()
            finished.add(rid)
            ncc, nb = info.pop(rid)
        cached = CachedRequestData()
        for rid in live:
            st = info[rid]
            st[0] += 1  # the previous step computed one token; the runner sampled one
            ncc = st[0]
            blocks = None
            if ncc + 1 > st[1] * block_size:
                blocks = tuple([next(free[g])] for g in range(num_groups))
                st[1] += 1
            cached.req_ids.append(rid)
            cached.resumed_from_preemption.append(False)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(blocks)
            cached.num_computed_tokens.append(ncc)
        new = admit(k)
        sched = dict.fromkeys(cached.req_ids, 1)
        sched.update((r.req_id, 1) for r in new)
        steps.append(SchedulerOutput(new, cached, sched, finished_req_ids=finished))
    config = dict(block_sizes=[block_size] * num_groups, max_num_reqs=num_reqs, max_model_len=max_model_len,
                  max_num_batched_tokens=max(2048, num_reqs), num_blocks=1 << 28)
    name = f"steady decode N={num_reqs}" + (" (int32 array prompts)" if prompt_arrays else "") + (
        "" if arrivals else ", no arrivals")
    return Workload(name, config, steps, num_warmup=1)


def record_trace_steps(kv: KVCacheConfig, num_steps: int, num_requests: int, budget: int, max_model_len: int,
                       max_num_seqs: int) -> list[SchedulerOutput]:
    """The first ``num_steps`` outputs of the real ``Scheduler`` over ``kv`` with the
    conversation trace's first ``num_requests`` requests queued at once (arrival times
    ignored); every row that completes its tokens samples the constant token 1."""
    from attnplug.runner.commands.traces import load_trace, make_prompts
    from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
    from attnplug.runner.step.scheduler_output import SamplingParams

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len), kv)
    trace = load_trace("conv", num_requests, max_model_len=max_model_len)
    for i, (req, prompt) in enumerate(zip(trace, make_prompts(trace, 32000))):
        sched.add_request(f"trace-{i}", prompt, SamplingParams(max_tokens=req.output_len))
    steps = []
    while len(steps) < num_steps and sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = {rid: [1] for rid, n in out.num_scheduled_tokens.items()
                   if sched.requests[rid].num_computed_tokens + n >= sched.requests[rid].num_tokens}
        sched.update_from_output(out, sampled)
        steps.append(out)
    return steps


def trace_replay(num_steps: int, num_requests: int = 2000, budget: int = 2048, max_model_len: int = 8192,
                 max_num_seqs: int = 256, num_blocks: int = 40000, sliding_window: int = 1024) -> Workload:
    """The first ``num_steps`` steps of the Azure conversation trace through the scheduler.

    All ``num_requests`` requests are queued at once (arrival times are ignored), so the
    steps mix chunked prefills and decodes under the ``budget``. Sampled tokens are a
    constant; the scheduler's rule decides which rows produce one.
    """
    kv = KVCacheConfig(num_blocks, (
        KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=16)),
        KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=16, sliding_window=sliding_window)),
    ))
    steps = record_trace_steps(kv, num_steps, num_requests, budget, max_model_len, max_num_seqs)
    config = dict(block_sizes=kv, max_num_reqs=max_num_seqs, max_model_len=max_model_len,
                  max_num_batched_tokens=budget)
    return Workload(f"trace replay (conv, {budget}-token budget)", config, steps, num_warmup=min(10, len(steps) // 10))
