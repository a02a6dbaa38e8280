"""When a request arrived and when each of its tokens became visible: what serving metrics
(TTFT, TPOT, ITL, E2EL) are computed from.

``LLMEngine`` records one :class:`RequestTiming` per request on its clock
(``runner/serve/clock.py``): the arrival time given to ``add_request`` (or the time of the
call), then one entry per engine step that made tokens of the request visible, at the time
the engine read that step's outputs. A step may make several tokens visible at once (a
speculative-decoding step that accepted drafts): that is one entry, as one streamed chunk
is one inter-token gap in ``vllm bench serve`` (``vllm/benchmarks/lib/endpoint_request_func.py``:
one ``itl`` value per chunk received).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """One request's times on the engine's clock (seconds).

    Attributes:
        arrival_time: when the request arrived (a client sent it); every latency counts
            from here, queueing included.
        chunk_times: per step that made tokens visible, the time the engine read them;
            non-decreasing.
        chunk_tokens: tokens made visible at ``chunk_times[i]`` (each ``>= 1``).
        first_scheduled_time: when a step first scheduled the request (``None`` before).
    """

    arrival_time: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        """Time to first token: first chunk minus arrival (``None`` before any token)."""
        return self.chunk_times[0] - self.arrival_time if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        """End-to-end latency: last chunk minus arrival (``None`` before any token)."""
        return self.chunk_times[-1] - self.arrival_time if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gap before each chunk after the first."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]
