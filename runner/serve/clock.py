"""The engine's clock: where arrival times and token times are read, and how it idles.

``LLMEngine.clock`` is a :class:`WallClock` unless a caller sets another: a test (or a
simulation) injects a :class:`ManualClock`, whose time moves only when told to, so that
arrival times, token times and the latency figures computed from them are known exactly.
Units: seconds, as floats; only differences between two readings of one clock mean anything.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """What the engine needs of a clock."""

    def now(self) -> float:
        """The current time, seconds (monotonic: never smaller than an earlier reading)."""

    def sleep(self, seconds: float) -> None:
        """Idle for ``seconds`` (``<= 0``: return at once)."""


class WallClock:
    """``time.perf_counter`` and ``time.sleep``: the real thing (``attnplug run``)."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class ManualClock:
    """A clock that moves only by :meth:`sleep` and :meth:`advance` (tests, simulations).

    Args:
        start: the first reading, seconds.
    """

    def __init__(self, start: float = 0.0):
        self.time = float(start)
        self.slept: list[float] = []
        """Every positive ``sleep`` asked for, in order (seconds)."""

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.slept.append(seconds)
            self.time += seconds

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` (``>= 0``) pass, e.g. the time a step takes.

        Raises:
            ValueError: a negative or non-finite ``seconds`` (a clock never runs back).
        """
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"a clock only moves forward by a finite amount, got {seconds!r}")
        self.time += seconds
