"""Rank 0's commands to the other ranks, in step order, over the host group.

A command is ``(kind, payload)``: :data:`BUILD` (payload: ``alone``, build the next
engine), :data:`STEP` / :data:`STEP_ASYNC` (payload: the ``SchedulerOutput``), :data:`EXIT`
and :data:`ERROR` (payload: rank 0's failure line: rank 0 failed between commands, e.g. its
scheduler raised, and the peers, waiting for the next command, stop at once with
:class:`SourceFailedError` instead of at the group's timeout). Every rank calls
:meth:`Channel.exchange` once per command: rank 0 with the command, the others with
``None``; it is one collective, so ranks cannot get out of order, and a dead peer or a
peer that stops answering raises (gloo: at once on a closed socket, else after the group's
timeout) instead of hanging.
"""

from __future__ import annotations

import pickle

import numpy as np
import torch
import torch.distributed as dist

from attnplug.core.errors import AttnplugError
from attnplug.runner.parallel.encoding import FixedBroadcast, broadcast_object, decode, encode
from attnplug.runner.parallel.state import ParallelState

BUILD, STEP, STEP_ASYNC, EXIT, ERROR = range(5)
KIND_NAMES = ("BUILD", "STEP", "STEP_ASYNC", "EXIT", "ERROR")
METHODS = ("fixed", "object", "tensor")
DEFAULT_METHOD = "fixed"
"""A pickle in one preallocated buffer: one broadcast per step instead of two, measured the
cheapest of the three on gloo for real steps (``attnplug bench broadcast``;
docs/distributed.md, "Broadcast"), and it carries any new ``SchedulerOutput`` field."""


class SourceFailedError(AttnplugError):
    """Rank 0 sent :data:`ERROR`: it failed outside a collective; ``str(e)`` is its failure
    line (``rank 0 of W failed: Type: message``)."""


class Channel:
    """One broadcast per command from rank 0 (``src``) on ``state.cpu_group``.

    Args:
        method: ``"fixed"`` (``encoding.FixedBroadcast`` of the command: one broadcast while
            it fits), ``"object"`` (``broadcast_object_list`` of the command) or ``"tensor"``
            (an ``int64`` header ``[kind, nbytes]``, then the bytes: ``encoding.encode`` for
            steps, pickle for the rare other payloads).
    """

    def __init__(self, state: ParallelState, method: str = DEFAULT_METHOD, src: int = 0):
        if method not in METHODS:
            raise ValueError(f"broadcast method {method!r}: choose one of {METHODS}")
        self.state, self.method, self.src = state, method, src
        self.is_src = state.rank == src
        self._fixed = FixedBroadcast() if method == "fixed" else None

    def exchange(self, command: tuple[int, object] | None = None) -> tuple[int, object]:
        """Rank 0: send ``command``; others: pass ``None`` and receive it."""
        if self._fixed is not None:
            return self._fixed(command, self.state.cpu_group, self.src)
        if self.method == "object":
            return broadcast_object(command, self.state.cpu_group, self.src)
        group = self.state.cpu_group
        if self.is_src:
            kind, payload = command
            body = encode(payload) if kind in (STEP, STEP_ASYNC) else pickle.dumps(payload)
            header = torch.tensor([kind, len(body)], dtype=torch.int64)
        else:
            header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, self.src, group=group)
        kind, size = header.tolist()
        buf = (torch.frombuffer(bytearray(body), dtype=torch.uint8) if self.is_src
               else torch.empty(size, dtype=torch.uint8))
        if size:
            dist.broadcast(buf, self.src, group=group)
        if self.is_src:
            return command
        data = np.asarray(buf).tobytes()
        return kind, (decode(data) if kind in (STEP, STEP_ASYNC) else pickle.loads(data))
