"""Requests that have not arrived yet: ``LLMEngine`` admits each one at its arrival time.

A min-heap on ``(arrival_time, order of add)``: requests that arrive at the same time are
admitted in the order they were added (the scheduler's FIFO then keeps that order).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from attnplug.runner.step.scheduler_output import SamplingParams


@dataclass(order=True)
class PendingRequest:
    """A validated request waiting for its arrival time (clock seconds)."""

    arrival_time: float
    order: int
    req_id: str = field(compare=False)
    prompt_token_ids: list[int] = field(compare=False)
    sampling_params: SamplingParams = field(compare=False)


class ArrivalQueue:
    """The pending requests of an engine, earliest arrival first."""

    def __init__(self) -> None:
        self._heap: list[PendingRequest] = []
        self._ids: set[str] = set()
        self._added = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._ids

    def push(self, arrival_time: float, req_id: str, prompt_token_ids: list[int],
             sampling_params: SamplingParams) -> None:
        heapq.heappush(self._heap, PendingRequest(arrival_time, self._added, req_id, prompt_token_ids,
                                                  sampling_params))
        self._ids.add(req_id)
        self._added += 1

    def next_arrival(self) -> float | None:
        """The earliest pending arrival time, or ``None`` when nothing is pending."""
        return self._heap[0].arrival_time if self._heap else None

    def pop_arrived(self, now: float) -> list[PendingRequest]:
        """Remove and return, in arrival order, every request with ``arrival_time <= now``."""
        out = []
        while self._heap and self._heap[0].arrival_time <= now:
            out.append(heapq.heappop(self._heap))
            self._ids.discard(out[-1].req_id)
        return out

    def remove(self, req_id: str) -> PendingRequest:
        """Take one pending request out (an abort before it arrived).

        Raises:
            KeyError: ``req_id`` is not pending.
        """
        if req_id not in self._ids:
            raise KeyError(req_id)
        i = next(i for i, p in enumerate(self._heap) if p.req_id == req_id)
        item = self._heap.pop(i)
        heapq.heapify(self._heap)
        self._ids.discard(req_id)
        return item
