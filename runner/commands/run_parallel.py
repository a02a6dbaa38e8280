"""``attnplug run`` under torchrun: the ``--tensor-parallel-size`` / ``--pipeline-parallel-size``
flags, joining the process group, and each rank's part (``runner/parallel/launch.py``).

Without torchrun (``WORLD_SIZE`` unset or 1) and with both sizes 1, :func:`wanted` is false
and ``attnplug run`` stays one process.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands.limits import bounded_int


def add_flags(p) -> None:
    """Add the parallel flags to ``attnplug run``'s parser."""
    p.add_argument("--tensor-parallel-size", type=bounded_int(1, 1024), default=1, metavar="N",
                   help="shard heads, MLP and vocabulary over N ranks (launch N processes with torchrun; "
                        "docs/distributed.md); an integer in [1, 1024] (default 1)")
    p.add_argument("--pipeline-parallel-size", type=bounded_int(1, 1024), default=1, metavar="N",
                   help="split the layers into N pipeline stages; tensor x pipeline size must equal "
                        "torchrun's WORLD_SIZE; an integer in [1, 1024] (default 1)")
    p.add_argument("--dist-broadcast", choices=("fixed", "object", "tensor"), default="fixed",
                   help="how rank 0 sends each step: a pickle in one fixed buffer (default, one broadcast), "
                        "broadcast_object_list, or the compact tensor encoding (runner/parallel/encoding.py; "
                        "measured by attnplug bench broadcast)")


def wanted(args) -> bool:
    """A distributed run: a size above 1, or launched by torchrun with ``WORLD_SIZE > 1``."""
    return (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1
            or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1)


def run(args, main: Callable[[], int]) -> int:
    """Join the group, then this rank's part; returns the exit status (2: sizes that do not
    fit the launch or the model, one line)."""
    from attnplug.runner.parallel.channel import Channel
    from attnplug.runner.parallel.launch import run_rank
    from attnplug.runner.parallel.state import init_parallel, shutdown

    try:
        state = init_parallel(args.tensor_parallel_size, args.pipeline_parallel_size, args.device)
    except AttnplugError as e:
        print(f"attnplug run: {e}", file=sys.stderr)
        return 2
    try:
        state.channel = Channel(state, args.dist_broadcast)
        args.device = state.device
        models: list = []

        def build(alone: bool):
            from attnplug.runner.commands.assemble import build_engine

            setup = build_engine(args, alone=alone, model=models[0] if models else None, requests=False)
            models[:] = [setup.model]
            return setup.engine.runner

        return run_rank(state, main, build)
    finally:
        shutdown()
