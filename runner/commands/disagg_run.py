"""``attnplug run --kv-connector disagg`` under ``torchrun --nproc-per-node 2``: prefill on
rank 0 (the producer), decode on rank 1 (the consumer) (``plugins/kv_connectors/
disagg_connector.py``; docs/kv-connectors.md).

Both ranks build the same workload (same flags, same seed). The producer runs every request
with one output token and prints its report on stderr; the consumer's report (stdout) is
the run's: its ``outputs_digest`` is the one-process run's. The batch-invariance replay
(``--invariance-requests``) is off on both ranks: it would compute prompts on the consumer.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Callable


def wanted(args) -> bool:
    return getattr(args, "kv_connector", None) == "disagg"


def _fail(msg: str) -> int:
    print(f"attnplug run: {msg}", file=sys.stderr)
    return 2


def run(args, main: Callable[[], int]) -> int:
    """Join the gloo group, install this rank's wire, run ``main`` as producer or consumer."""
    from attnplug.core.errors import ConfigError
    from attnplug.plugins.kv_connectors import disagg_channel as wire
    from attnplug.runner.commands.kv_connector_setup import parse_config

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world != 2:
        return _fail("--kv-connector disagg: launch two ranks, torchrun --nproc-per-node 2 -m attnplug run ...")
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        return _fail("--kv-connector disagg: not with --tensor-parallel-size / --pipeline-parallel-size > 1")
    try:
        cfg = parse_config(args.kv_connector_config)
    except ConfigError as e:
        return _fail(str(e))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    role = "producer" if rank == 0 else "consumer"
    try:
        fits = getattr(args, "kv_role", None) in (None, role) and cfg.get("role", role) == role
        agreed = torch.tensor([int(fits)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # both ranks go on, or both stop
        if not fits:
            return _fail(f"--kv-role: rank {rank} is the {role} (rank 0 prefills, rank 1 decodes)")
        if not agreed.item():
            return _fail("--kv-role: the other rank refused its role")
        cfg["role"] = role
        args.invariance_requests = 0  # its batch-of-one replays would compute prompts here
        args.kv_connector_config = json.dumps(cfg)
        channel = (wire.PeerChannel(role, send=wire.torch_send(1)) if role == "producer"
                   else wire.PeerChannel(role, recv=wire.torch_recv(0)))
        wire.install(channel)
        try:
            if role == "producer":
                args.output_len = 1  # prefill and the first token only
                with contextlib.redirect_stdout(sys.stderr):
                    return main()
            return main()
        finally:
            channel.close()  # consumer: drains the wire until the producer's end (so it never blocks)
            wire.install(None, role)
    finally:
        dist.barrier()
        dist.destroy_process_group()
