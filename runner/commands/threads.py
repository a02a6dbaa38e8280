"""The commands' torch thread policy: ``--torch-threads N``, ``ATTNPLUG_TORCH_THREADS``, and a
default that does not oversubscribe the CPUs (docs/performance.md, "Torch threads").

Precedence, first that is set: the ``--torch-threads`` flag, the ``ATTNPLUG_TORCH_THREADS``
environment variable, ``OMP_NUM_THREADS`` (torch already read it at import: it is kept), else
the command's default. The default of ``attnplug run`` and ``attnplug parity`` is
:func:`default_threads`: the CPUs this process may run on (``os.sched_getaffinity``) divided
among the local ranks (torchrun's ``LOCAL_WORLD_SIZE``), minus the CPUs other processes keep busy
(the 1-minute load average, whole CPUs), at least 1. torch's intra-op threads wait for each
other at the end of every parallel region; on a CPU another process holds, that wait is a
time slice, which is why more threads than free CPUs runs several times slower than one
thread (measured in docs/performance.md). The benchmarks default to 1 thread (the figures of
one implementation against another, reproducible on a shared machine) and take the flag and
the variable the same way. Every timing table records ``torch.get_num_threads()``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Mapping

ENV_VAR = "ATTNPLUG_TORCH_THREADS"
BIND_VAR = "ATTNPLUG_OMP_BIND"
"""``ATTNPLUG_OMP_BIND=1``: pin torch's OpenMP threads one per CPU (:func:`bind`); ``0`` or unset:
leave them to the scheduler (the default)."""
FLAG = "--torch-threads"
MAX_THREADS = 1024
"""Highest thread count accepted by the flag and the variable."""


def usable_cpus() -> int:
    """CPUs this process may run on: ``len(os.sched_getaffinity(0))`` where the OS has it
    (Linux), else ``os.cpu_count()``, at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def local_ranks(environ: Mapping[str, str]) -> int:
    """Processes of this run on this machine: torchrun's ``LOCAL_WORLD_SIZE`` (a positive
    decimal int), else 1."""
    text = environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else 1


def default_threads(cpus: int, ranks: int, load_average: float) -> int:
    """The default thread count: ``cpus // ranks`` (this rank's share), lowered to what the
    other processes leave free — ``(cpus - floor(load_average)) // ranks`` — at least 1.

    Args:
        cpus: CPUs this process may use (:func:`usable_cpus`), >= 1.
        ranks: local ranks sharing them (:func:`local_ranks`), >= 1.
        load_average: the 1-minute load average (runnable tasks, ``os.getloadavg()[0]``);
            a fraction of a CPU busy counts as free.
    """
    share = cpus // max(ranks, 1)
    free = (cpus - math.floor(max(load_average, 0.0))) // max(ranks, 1)
    return max(1, min(share, free))


def _parse(text: str, origin: str) -> int:
    """A thread count from ``text``: a decimal int in ``[1, MAX_THREADS]``, else ``ValueError``
    with one line naming ``origin``."""
    s = text.strip()
    if not (s.isascii() and s.isdigit()) or not 1 <= int(s) <= MAX_THREADS:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ValueError(f"{origin} must be an integer in [1, {MAX_THREADS}], got {shown!r}")
    return int(s)


def resolve(flag: str | None, environ: Mapping[str, str], default: int | None = None,
            load_average: float | None = None) -> tuple[int, str]:
    """The thread count and where it came from (``--torch-threads``, ``ATTNPLUG_TORCH_THREADS``,
    ``OMP_NUM_THREADS``, ``default``), by the precedence of the module docstring.

    Args:
        flag: the flag's text, or ``None`` when it was not given.
        environ: the environment (``os.environ``).
        default: the command's default count; ``None``: :func:`default_threads` of this
            machine (``load_average`` defaults to ``os.getloadavg()[0]``).

    Raises:
        ValueError: one line naming the flag or variable whose value is not an integer in
            ``[1, MAX_THREADS]`` (an ``OMP_NUM_THREADS`` torch cannot read is left to torch).
    """
    if flag is not None:
        return _parse(flag, FLAG), FLAG
    if environ.get(ENV_VAR, "") != "":
        return _parse(environ[ENV_VAR], ENV_VAR), ENV_VAR
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isascii() and omp.isdigit() and int(omp) > 0:
        return min(int(omp), MAX_THREADS), "OMP_NUM_THREADS"
    if default is not None:
        return default, "default"
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except OSError:
            load_average = 0.0
    return default_threads(usable_cpus(), local_ranks(environ), load_average), "default"


def add_flag(parser, default_text: str = "the CPUs free for this process (docs/performance.md)") -> None:
    """Add ``--torch-threads N`` to an ``argparse`` parser (kept as text: :func:`apply` checks it)."""
    parser.add_argument(FLAG, dest="torch_threads", default=None, metavar="N",
                        help=f"torch intra-op threads, an integer in [1, {MAX_THREADS}]; beats {ENV_VAR} and "
                             f"OMP_NUM_THREADS; default: {default_text}")


def apply(flag: str | None, prog: str, default: int | None = None) -> int | None:
    """Resolve the thread count (:func:`resolve`) and ``torch.set_num_threads`` it.

    Returns ``None`` when set, or 2 after printing one line ``PROG: ...`` on stderr naming
    the bad flag or variable (nothing is changed then)."""
    import sys

    import torch

    try:
        n, _ = resolve(flag, os.environ, default)
        pin = binding_asked(os.environ)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if pin:
        bind(n)
    return None


WAIT_POLICY_COMMANDS = frozenset({"run", "serve", "parity", "bench", "check"})
"""The subcommands that run models (and load torch anyway): :func:`load_torch_waiting_passively`."""


def machine_is_shared(cpus: int, load_average: float) -> bool:
    """Other processes keep at least one CPU busy: ``floor(load_average) >= 1`` (the same
    reading of the load as :func:`default_threads`; ``cpus`` only bounds it)."""
    return cpus >= 1 and math.floor(max(load_average, 0.0)) >= 1


BUSY_SAMPLE_S = 0.1
"""How long :func:`busy_cpus_now` watches ``/proc/stat`` (seconds)."""


def busy_cpus_now(interval: float = BUSY_SAMPLE_S) -> float | None:
    """CPUs kept busy by all processes over the next ``interval`` seconds (``/proc/stat``'s
    aggregate ``cpu`` line read twice: non-idle jiffies over all jiffies, times the CPUs
    counted there), or ``None`` where it cannot be read (not Linux). The caller sleeps
    through the interval, so its own share is ~0."""
    def sample() -> tuple[int, int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
        fields = [int(v) for v in lines[0].split()[1:]]
        cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle, cpus
    try:
        total0, idle0, cpus = sample()
        time.sleep(interval)
        total1, idle1, _ = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return cpus * (1.0 - (idle1 - idle0) / (total1 - total0))


def load_torch_waiting_passively(load_average: float | None = None) -> bool:
    """On a shared machine (:func:`machine_is_shared`), import torch with
    ``OMP_WAIT_POLICY=PASSIVE`` in the environment, then take the variable out again:
    libgomp reads its environment once, when torch loads it, so torch's OpenMP threads then
    sleep at the end of a parallel region instead of spinning, and no child process (vLLM's
    worker in ``bench engine``) inherits the setting. On a loaded machine a spinning thread
    holds a CPU that the thread with the remaining work needs (tiny-llama at 2 threads ran
    2.6–10× faster passive at load 1.6–3.7); on a quiet one the wake-ups cost more than the
    spinning (tiny-llama at 2 threads, load < 1: forward 10.1 ms/step passive against 6.9
    with libgomp's default), so below a load of 1 libgomp's default stays (docs/performance.md,
    "The forward outside attention, fourth pass" and "Issue 38 at the end of session 12").
    Nothing is done when torch is already imported or the user set ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` (theirs is kept). When it sets the policy it also tells
    ``runner/models/cpu_ops`` (``set_wait_passive``), whose fused ops then split a call over
    the threads only from far more work. ``load_average`` defaults to ``os.getloadavg()[0]``
    (0 where the OS has none). A load average of 1 or more is then checked against the CPUs
    busy right now (:func:`busy_cpus_now`, 0.1 s): below one busy CPU the machine is taken as
    quiet (the average still counts a process that ended up to a minute ago, e.g. the
    previous round of a benchmark). Returns whether it was set."""
    import sys

    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except OSError:
            load_average = 0.0
    if not machine_is_shared(usable_cpus(), load_average):
        return False
    busy = busy_cpus_now()  # the 1-minute average lags: a process that just ended still counts
    if busy is not None and busy < 1.0:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        import torch  # noqa: F401  (loads libgomp, which reads OMP_WAIT_POLICY now)
    finally:
        del os.environ["OMP_WAIT_POLICY"]
    from attnplug.runner.models import cpu_ops

    cpu_ops.set_wait_passive(True)  # its ops' parallel threshold for sleeping threads
    return True


def binding_asked(environ: Mapping[str, str]) -> bool:
    """``ATTNPLUG_OMP_BIND`` is ``1`` (``0``, empty or unset: ``False``).

    Raises:
        ValueError: any other value (one line naming the variable)."""
    value = environ.get(BIND_VAR, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{BIND_VAR} must be 0 or 1, got {value!r}")
    return value == "1"


def bind_plan(n: int, cpus: list[int]) -> list[list[int]]:
    """Thread ``t`` of ``n`` on CPU ``cpus[t % len(cpus)]`` (sorted), one CPU per thread."""
    cpus = sorted(cpus)
    return [[cpus[t % len(cpus)]] for t in range(n)]


def bind(n: int) -> None:
    """Pin torch's ``n`` OpenMP threads one per CPU of ``os.sched_getaffinity`` (:func:`bind_plan`;
    vLLM's CPU build does the like with ``VLLM_CPU_OMP_THREADS_BIND``), through
    ``runner/models/cpu_ops.bind_threads``. One thread is not pinned. Measured at 2 threads on
    the loaded 2-core machine: docs/performance.md, "The forward outside attention, fourth pass".

    Raises:
        RuntimeError: the compiled module ``runner/models/_cpu_ops`` is not built."""
    if n <= 1:
        return
    from attnplug.runner.models import cpu_ops

    cpu_ops.bind_threads(bind_plan(n, list(os.sched_getaffinity(0))))


__all__ = ["BIND_VAR", "ENV_VAR", "FLAG", "MAX_THREADS", "WAIT_POLICY_COMMANDS", "add_flag", "apply", "bind", "bind_plan",
           "binding_asked", "busy_cpus_now", "load_torch_waiting_passively", "machine_is_shared", "default_threads", "local_ranks", "resolve",
           "usable_cpus"]
