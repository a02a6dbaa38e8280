"""Helpers of tests/distributed: spawn W real processes joined by a gloo process group
(``torch.multiprocessing``, spawn start method), and run one engine on every rank.

A rank function is ``fn(rank, *args) -> int`` (its exit status); the environment torchrun
would set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) is set
before it runs, so ``init_parallel`` joins exactly as under torchrun.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, env: dict, args: tuple) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})
    torch.set_num_threads(1)
    sys.exit(fn(rank, *args))


def spawn(fn, world: int, *args, env: dict | None = None, timeout: float = 120.0) -> tuple[list[int], float]:
    """Run ``fn(rank, *args)`` on ``world`` processes; returns (exit codes, seconds). A process
    still alive after ``timeout`` is killed (exit code then negative) — a hang fails the test."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, dict(env or {}), args)) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, timeout - (time.monotonic() - t0)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs], time.monotonic() - t0


def engine_args(num_reqs: int, force_preemption: bool, block_size: int = 4, max_model_len: int = 64,
                num_blocks: int | None = None) -> SimpleNamespace:
    """The options ``build_engine`` reads (as ``attnplug parity`` sets them)."""
    return SimpleNamespace(model=None, backend=None, block_size=block_size, seed=0, max_model_len=max_model_len,
                           max_num_seqs=num_reqs, max_num_batched_tokens=16, num_blocks=num_blocks,
                           force_preemption_every=3 if force_preemption else None, record_logits=False,
                           async_scheduling=False, device="cpu")


def build_loaded(cfg: dict, state_dict: dict, block_size: int):
    """The model of this process (a TP rank's shard under ``init_parallel``, else the whole
    model) through the same path as ``attnplug run``, with ``state_dict``'s weights."""
    from attnplug.runner.commands.assemble import resolve_backend
    from attnplug.runner.commands.model_loading import build_with_backends
    from attnplug.runner.parallel.sharding import shard_state_dict
    from attnplug.runner.parallel.state import current

    model = build_with_backends(cfg, backend=None, block_size=block_size, resolve=resolve_backend)
    state = current()
    if state is not None and state.tp_size > 1:
        state_dict = shard_state_dict(state_dict, model.full_config, state.tp_size, state.tp_rank)
    model.load_hf_state_dict(state_dict)
    return model


def run_engine(model, args, prompts: dict[str, list[int]], max_tokens: int):
    """``(tokens per request, setup)`` after running every prompt to ``max_tokens`` greedily."""
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.step.scheduler_output import SamplingParams

    setup = build_engine(args, model=model, requests=False)
    for rid, p in prompts.items():
        setup.engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    results = setup.engine.run()
    return {rid: r.output_token_ids for rid, r in results.items()}, setup


def cache_facts(model, runner) -> dict:
    """What this rank's caches hold: the layers it allocated caches for (the runner's
    ``kv_caches``), each attention layer's KV heads (its spec), each Mamba2 layer's SSM
    heads (the allocated state tensor ``[slots, heads, head_size, state]``) and each GDN
    layer's value heads and conv channels (``recurrent_state [slots, heads, d_k, d_v]``,
    ``conv_state [slots, conv_dim, kernel - 1]``)."""
    specs = model.kv_cache_specs(4)
    caches = runner.kv_caches.values()
    return {"layers": list(runner.kv_caches),
            "kv_heads": [s.num_kv_heads for s in specs.values() if hasattr(s, "num_kv_heads")],
            "mamba_ssm_heads": [c.ssm_state.shape[1] for c in caches if hasattr(c, "ssm_state")],
            "gdn_state": [[c.recurrent_state.shape[1], c.conv_state.shape[1]]  # value heads, conv channels
                          for c in caches if hasattr(c, "recurrent_state")]}


def tp_cases(rank: int, cases: list[dict], outdir: str, pp: int = 1) -> int:
    """Rank function: each case (``cfg``, ``state_dict`` path, ``prompts``, ``max_tokens``,
    ``preempt``, ``method``) is one ``run_rank`` session on ``WORLD_SIZE / pp`` x ``pp``
    ranks; rank 0 writes
    ``outdir/<name>.json`` with the tokens, preemptions and metadata checks done, and every
    rank ``outdir/<name>.rank<R>.json`` with its :func:`cache_facts`."""
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.parallel.channel import Channel
    from attnplug.runner.parallel.launch import run_rank
    from attnplug.runner.parallel.state import init_parallel, shutdown

    state = init_parallel(int(os.environ["WORLD_SIZE"]) // pp, pp)
    from attnplug.runner.parallel.encoding import FixedBroadcast

    small = FixedBroadcast(capacity=64)  # the fitting path, then the second broadcast of a larger one
    for obj in ({"a": 1}, {"big": list(range(100))}):
        if small(obj if rank == 0 else None, state.cpu_group) != obj:
            return 5
    status = 0
    for case in cases:
        state.channel = Channel(state, case.get("method", "fixed"))
        model = build_loaded(case["cfg"], torch.load(case["state_dict"]), 4)
        args = engine_args(len(case["prompts"]), case["preempt"], num_blocks=case.get("num_blocks"))
        runners = []

        def main() -> int:
            tokens, setup = run_engine(model, args, case["prompts"], case["max_tokens"])
            runners.append(setup.engine.runner)
            check = setup.engine.runner.on_common_metadata
            with open(os.path.join(outdir, case["name"] + ".json"), "w") as f:
                json.dump({"tokens": tokens, "preemptions": setup.engine.scheduler.num_preemptions,
                           "steps": setup.engine.stats.num_steps,
                           "checked_steps": getattr(check, "step", 0)}, f)
            return 0

        def build(alone: bool):
            runners.append(build_engine(args, alone=alone, model=model, requests=False).engine.runner)
            return runners[-1]

        status |= run_rank(state, main, build)
        if status:  # after a failure the ranks may be out of step: end here (as attnplug run does)
            break
        with open(os.path.join(outdir, f"{case['name']}.rank{rank}.json"), "w") as f:
            json.dump(cache_facts(model, runners[-1]), f)
    shutdown()
    return status


def _tamper(out):
    """Rank 1's view of step 0: the first new request computes one token less."""
    if out.scheduled_new_reqs and not getattr(_tamper, "done", False):
        _tamper.done = True
        rid = out.scheduled_new_reqs[0].req_id
        out.num_scheduled_tokens[rid] -= 1
        out.total_num_scheduled_tokens -= 1
    return out


def _raise_at_step_2(out, seen=[]):  # noqa: B006 (a per-process step counter)
    seen.append(1)
    if len(seen) == 3:
        raise RuntimeError("planted fault in step 2")
    return out


def _scheduler_raising_at_call_3(model, args, case):
    """Rank 0's ``main`` whose scheduler raises on its third ``schedule()``: between steps,
    while the peers wait for the next command."""
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.step.scheduler_output import SamplingParams

    def main() -> int:
        setup = build_engine(args, model=model, requests=False)
        for rid, p in case["prompts"].items():
            setup.engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=case["max_tokens"]))
        schedule, calls = setup.engine.scheduler.schedule, []

        def failing():
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("planted scheduler fault before step 2")
            return schedule()

        setup.engine.scheduler.schedule = failing
        setup.engine.run()
        return 0
    return main


def fault_cases(rank: int, case: dict, outdir: str) -> int:
    """Rank function: (1) rank 1 is fed a different step 0 (the metadata check must stop both
    ranks); (2) rank 0's scheduler raises between steps (rank 1 must stop at once, naming rank
    0's error); (3) rank 1 raises in step 2 (both ranks must end, each with its line). Each
    rank's failure lines go to ``outdir/rank<R>.err``, each phase's end as ``status S at T``
    (``T``: ``time.time()``)."""
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.parallel.channel import Channel
    from attnplug.runner.parallel.launch import run_rank
    from attnplug.runner.parallel.state import init_parallel

    state = init_parallel(int(os.environ["WORLD_SIZE"]))
    state.channel = Channel(state)
    model = build_loaded(case["cfg"], torch.load(case["state_dict"]), 4)
    args = engine_args(len(case["prompts"]), False)
    main = lambda: run_engine(model, args, case["prompts"], case["max_tokens"]) and 0  # noqa: E731
    build = lambda alone: build_engine(args, alone=alone, model=model, requests=False).engine.runner  # noqa: E731
    phases = ((main, _tamper if rank == 1 else None), (_scheduler_raising_at_call_3(model, args, case), None),
              (main, _raise_at_step_2 if rank == 1 else None))
    statuses = []
    with open(os.path.join(outdir, f"rank{rank}.err"), "w") as err:
        for phase_main, hook in phases:
            statuses.append(run_rank(state, phase_main, build, on_output=hook, err=err))
            err.write(f"status {statuses[-1]} at {time.time()}\n")
            err.flush()
    os._exit(0 if statuses == [1, 1, 1] else 3)  # no shutdown: the peer may be gone
