"""Run one rank of a distributed command: rank 0 its command, the others the serve loop;
any rank that raises is reported as ``rank R of W failed: Type: message`` and the
command ends there on every rank. Rank 0 failing between commands broadcasts ``ERROR`` with
its line, so the peers (waiting for the next command) stop at once and repeat it; otherwise
no rank waits forever: the channel and the model's collectives raise when a peer is gone,
or after the group's timeout.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TextIO

import torch.distributed as dist

from attnplug.runner.parallel.channel import ERROR, EXIT, SourceFailedError
from attnplug.runner.parallel.executor import serve
from attnplug.runner.parallel.state import ParallelState
from attnplug.runner.parallel.validate import RankMismatchError

PEER_HINT = " (another rank failed or exited first: see its line)"


def failure_line(state: ParallelState, exc: BaseException) -> str:
    """``rank R of W failed: Type: message`` (one line), with a hint when the error is a
    collective that lost its peer."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 400 else text[:400] + "..."
    peer = isinstance(exc, (dist.DistError, ConnectionError)) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))
    return f"rank {state.rank} of {state.world_size} failed: {type(exc).__name__}: {text}" + (PEER_HINT if peer else "")


def run_rank(state: ParallelState, main: Callable[[], int], build: Callable[[bool], Any], *,
             on_output: Callable[[Any], Any] | None = None, err: TextIO | None = None,
             prefix: str = "attnplug run: ") -> int:
    """This rank's part of a distributed command; returns its exit status.

    Args:
        state: the rank, with ``state.channel`` set.
        main: rank 0's command (it builds engines through ``executor.wrap_runner`` and runs
            them); returns its status.
        build: the other ranks' ``build(alone) -> ModelRunner`` (``executor.serve``).
        on_output: the other ranks' hook on each received step (tests).
        err: where a failure line goes (default ``sys.stderr``).

    Status: rank 0 ``main()``'s; other ranks 0 after ``EXIT``, 1 after rank 0 sent
    ``ERROR`` (reported on ``err`` as ``rank R of W stopped: rank 0 of W failed: ...``: rank 0
    raised outside a collective, e.g. in its scheduler between steps, and told the peers at
    once); 1 on a rank that raised (reported on ``err``).
    """
    err = err or sys.stderr
    try:
        if state.rank != 0:
            try:
                status = serve(state.channel, build, on_output)
            except SourceFailedError as e:  # rank 0's line, from the rank that stops because of it
                print(f"{prefix}rank {state.rank} of {state.world_size} stopped: {e}", file=err, flush=True)
                return 1
            if status == 0:
                dist.barrier(group=state.cpu_group)  # see below
            return status
        try:
            status = main()
        except Exception as e:
            line = failure_line(state, e)
            print(prefix + line, file=err, flush=True)
            # The peers wait for the next command: tell them, unless they know already (every
            # rank raises a RankMismatchError together) or are gone.
            if not line.endswith(PEER_HINT) and not isinstance(e, RankMismatchError):
                try:
                    state.channel.exchange((ERROR, line))
                except Exception:
                    pass
            return 1
        state.channel.exchange((EXIT, None))
        # Leave together: a rank that tore its group down while a peer was still reading the
        # last broadcast made gloo abort that peer ("terminate called ..."), now and then.
        dist.barrier(group=state.cpu_group)
        return status
    except Exception as e:
        print(prefix + failure_line(state, e), file=err, flush=True)
        return 1
