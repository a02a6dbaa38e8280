"""``attnplug bench broadcast``: what sending each step's ``SchedulerOutput`` from rank 0
costs, ``broadcast_object_list`` against a pickle in one fixed buffer and the compact tensor encoding, on real steps.

Run it under torchrun (2 processes; gloo on the CPU)::

    torchrun --nproc-per-node 2 -m attnplug bench broadcast [--num-requests 48] [--json]

Rank 0 first runs ``attnplug run``'s engine (tiny-llama, the bundled conversation trace,
one process) and records every step's output, with the step compiler's update + prepare
time per step; then the three methods send every recorded step (``--repeat`` times), interleaved step by step,
each behind a barrier. A step's time is the slower rank's (rank 0: encode + send; the
others: receive + decode); the table gives medians over the steps, and bytes per step.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time

import numpy as np


def _record(num_requests: int):
    from types import SimpleNamespace

    from attnplug.runner.commands.assemble import build_engine

    args = SimpleNamespace(model="tiny-llama", backend=None, block_size=16, seed=0, max_model_len=1024,
                           max_num_seqs=16, max_num_batched_tokens=512, num_blocks=None, trace="conv",
                           num_requests=num_requests, skip_invalid=False, device="cpu")
    setup = build_engine(args)
    seen, run = [], setup.engine.runner.execute_model
    setup.engine.runner.execute_model = lambda out: (seen.append(out), run(out))[1]
    for rid, p in setup.prompts.items():
        setup.engine.add_request(rid, p, setup.sampling_params[rid])
    setup.engine.run()
    stages = setup.engine.runner.median_stage_us()
    return [o for o in seen if o.total_num_scheduled_tokens], stages["update_states"] + stages["prepare_inputs"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="attnplug bench broadcast", description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--repeat", type=int, default=3, help="send every step this many times (default 3)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    from attnplug.runner.parallel.encoding import FixedBroadcast, broadcast_object, broadcast_tensor, encode
    from attnplug.runner.parallel.state import init_parallel, shutdown

    import os

    # Rank 0 records in one process first (no group yet, so the model is whole); the
    # others wait for it in init_process_group, up to the timeout.
    outs, host_us = _record(args.num_requests) if os.environ.get("RANK", "0") == "0" else ([], 0.0)
    os.environ.setdefault("ATTNPLUG_DIST_TIMEOUT", "900")
    try:
        state = init_parallel(int(os.environ.get("WORLD_SIZE", "1")))
    except Exception as e:
        print(f"attnplug bench broadcast: {e} (run it under torchrun --nproc-per-node 2)", file=sys.stderr)
        return 2
    rank, group = state.rank, state.cpu_group
    n = broadcast_object(len(outs), group)
    methods = {"object": broadcast_object, "fixed": FixedBroadcast(), "tensor": broadcast_tensor}
    times = {m: [] for m in methods}
    for i in [i for _ in range(args.repeat) for i in range(n)]:
        for method, send in methods.items():
            dist.barrier(group=group)
            t0 = time.perf_counter_ns()
            send(outs[i] if rank == 0 else None, group)
            mine = torch.tensor([time.perf_counter_ns() - t0], dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in range(state.world_size)]
            dist.all_gather(every, mine, group=group)
            times[method].append(max(int(t) for t in every))
    if rank == 0:
        res = {"steps": n, "repeat": args.repeat, "world_size": state.world_size, "torch_threads": torch.get_num_threads(),
               "update_plus_prepare_us": round(host_us, 1)}
        for method in times:
            res[f"{method}_us"] = round(float(np.median(times[method])) / 1e3, 1)
        res["object_bytes"] = int(np.median([len(pickle.dumps(o)) for o in outs]))
        res["tensor_bytes"] = int(np.median([len(encode(o)) for o in outs]))
        t0 = time.perf_counter_ns()
        for o in outs:
            encode(o)
        res["encode_us"] = round((time.perf_counter_ns() - t0) / 1e3 / max(n, 1), 1)
        t0 = time.perf_counter_ns()
        for o in outs:
            pickle.dumps(o)
        res["pickle_dumps_us"] = round((time.perf_counter_ns() - t0) / 1e3 / max(n, 1), 1)
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            for k, v in res.items():
                print(f"{k:>24} {v}")
    dist.barrier(group=group)
    shutdown()
    return 0
