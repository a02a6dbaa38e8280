"""The process group of a tensor-parallel run: who this rank is, which device and groups it uses.

``init_parallel`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` or a rendezvous) through ``init_process_group(init_method="env://")``
and sets the process-wide :class:`ParallelState` that the model builder and the runner
wrapper read (:func:`current`); ``attnplug run`` without torchrun never calls it, so
:func:`current` stays ``None`` and nothing of this package runs.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from attnplug.core.errors import AttnplugError

DEFAULT_TIMEOUT_S = 120.0
"""Seconds any collective may wait for its peers before it raises (``init_process_group(timeout=)``);
``ATTNPLUG_DIST_TIMEOUT`` overrides it."""


class ParallelConfigError(AttnplugError, ValueError):
    """Parallel sizes that do not fit the launch (``tp * pp != WORLD_SIZE``) or the model."""


@dataclass
class CollectiveTimer:
    """Nanoseconds spent in the tensor-parallel collectives (all-reduce, all-gather) since
    the last :meth:`take` (the collectives are synchronous on the CPU with gloo; on CUDA
    with NCCL this counts only the launch unless the caller synchronises)."""

    ns: int = 0
    calls: int = 0

    def take(self) -> tuple[int, int]:
        out = (self.ns, self.calls)
        self.ns = self.calls = 0
        return out


@dataclass
class ParallelState:
    """One rank of a ``tp_size`` x ``pp_size`` run: global rank ``pp_rank * tp_size + tp_rank``.

    Attributes:
        rank, world_size: this process in the default group (``torch.distributed``).
        tp_rank, tp_size: this rank in its stage's tensor-parallel group.
        pp_rank, pp_size: this rank's pipeline stage (0 embeds, ``pp_size - 1`` samples).
        device: ``cpu`` (gloo) or ``cuda:<LOCAL_RANK>`` (NCCL).
        tp_group: the group of the tensor-parallel collectives (``None``: the default group).
        cpu_group: a gloo group for the host-side broadcasts (the scheduler output, the
            metadata hashes): the default group itself on the CPU, a second gloo group when
            the default one is NCCL.
        timer: time spent in the model's collectives.
    """

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_size: int
    device: str
    pp_rank: int = 0
    tp_group: Any = None
    cpu_group: Any = None
    timer: CollectiveTimer = field(default_factory=CollectiveTimer)
    channel: Any = None
    """Rank 0's command channel (``channel.Channel``), set by the launcher."""

    def stage_rank(self, stage: int) -> int:
        """The global rank of this rank's tensor-parallel peer in pipeline stage ``stage``."""
        return stage * self.tp_size + self.tp_rank


_STATE: ParallelState | None = None


def current() -> ParallelState | None:
    """The process's :class:`ParallelState`, or ``None`` outside a distributed run."""
    return _STATE


def set_state(state: ParallelState | None) -> None:
    """Install (or clear) the process-wide state (``init_parallel`` and tests use it)."""
    global _STATE
    _STATE = state


def check_sizes(tp: int, pp: int, world_size: int, command: str = "run") -> None:
    """Raise :class:`ParallelConfigError` unless ``tp * pp == world_size`` (the message shows
    the torchrun line for ``attnplug <command>``)."""
    if tp * pp != world_size:
        raise ParallelConfigError(
            f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} = {tp * pp} process{'es' if tp * pp != 1 else ''}, but "
            f"WORLD_SIZE is {world_size}: launch with torchrun --nproc-per-node {tp * pp} -m attnplug {command} ...")


def timeout_s() -> float:
    """The collective timeout in seconds (``ATTNPLUG_DIST_TIMEOUT`` or :data:`DEFAULT_TIMEOUT_S`)."""
    raw = os.environ.get("ATTNPLUG_DIST_TIMEOUT")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ParallelConfigError(f"ATTNPLUG_DIST_TIMEOUT={raw!r} is not a number of seconds") from None


def init_parallel(tp: int, pp: int = 1, device: str = "cpu", command: str = "run") -> ParallelState:
    """Join the process group torchrun set up and install the :class:`ParallelState`.

    Args:
        tp, pp: tensor- and pipeline-parallel sizes; ``tp * pp`` must be ``WORLD_SIZE``.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, device ``cuda:<LOCAL_RANK>``).
        command: the ``attnplug`` subcommand the size error's torchrun line names.

    Raises:
        ParallelConfigError: sizes that do not match ``WORLD_SIZE`` (read before anything
            is initialised), or ``cuda`` without CUDA.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_sizes(tp, pp, world, command)
    kind = str(device).split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ParallelConfigError("--device cuda with tensor parallel, but CUDA is not available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=timeout_s())
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", init_method="env://", timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        dev = f"cuda:{local_rank}"
    else:
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        cpu_group, dev = dist.group.WORLD, "cpu"
    rank = dist.get_rank()
    tp_group = dist.group.WORLD
    if pp > 1:  # one tensor-parallel group per stage; every rank creates every group, in order
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
            if stage == rank // tp:
                tp_group = group
    state = ParallelState(rank=rank, world_size=world, tp_rank=rank % tp, tp_size=tp, pp_size=pp, device=dev,
                          pp_rank=rank // tp, tp_group=tp_group, cpu_group=cpu_group)
    set_state(state)
    return state


def shutdown() -> None:
    """Leave the process group (if joined) and clear the state.

    The state's group handles are dropped too: runners and channels keep the state, and a
    gloo group that outlives ``destroy_process_group`` until the interpreter exits was
    destroyed there, with its threads, now and then aborting the process ("terminate
    called without an active exception").
    """
    if _STATE is not None:
        _STATE.tp_group = _STATE.cpu_group = _STATE.channel = None
    set_state(None)
    if dist.is_initialized():
        dist.destroy_process_group()
