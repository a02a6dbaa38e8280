"""Capturing and replaying the model forward in CUDA graphs, and the runner's per-step
graph logic (:class:`StepGraphs`): dispatch, padded metadata, capture-or-replay.

A graph is captured the first time a padded shape (:attr:`PaddedBatch.key`) runs, from
that real step: one eager warm-up on a side stream (it writes the step's K/V, which the
capture's replay writes again, identically), the capture, then a replay that computes
the step. Later steps of that shape only replay. Replays read the persistent buffers
the forward was captured with: the step compiler's input ids and positions, the
builders' metadata buffers, the KV caches; so a builder used here must build into
persistent buffers (``AttentionCGSupport`` above ``NEVER``, which the negotiation
ensures).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from attnplug.core.contracts import AttentionMetadataBuilder
from attnplug.core.devices import resolve_device
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.execute.cudagraph import (
    DEFAULT_CAPTURE_SIZES,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    GraphModeDecision,
    PaddedBatch,
    PaddedMetadata,
    batch_shape,
    negotiate_cudagraph_mode,
)


class CUDAGraphRunner:
    """One CUDA graph per padded shape over a forward function, sharing a memory pool.

    Args:
        device: a CUDA device.

    Attributes:
        num_captures: graphs captured so far; ``num_replays``: replays run.
    """

    def __init__(self, device: torch.device | str):
        self.device = resolve_device(device)
        self._graphs: dict[Any, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool = None
        self.num_captures = 0
        self.num_replays = 0

    def __contains__(self, key: Any) -> bool:
        return key in self._graphs

    def run(self, key: Any, forward: Callable[[], Any]) -> Any:
        """Replay the graph of ``key`` (capturing it from ``forward`` first if needed).

        Args:
            key: the padded shape.
            forward: runs the step's forward on persistent buffers and returns its output.

        Returns:
            The graph's static output (overwritten by the next replay of ``key``).
        """
        entry = self._graphs.get(key)
        if entry is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                forward()  # warm-up: lazy inits and autotuning happen outside the capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = forward()
            self._pool = graph.pool()
            entry = self._graphs[key] = (graph, out)
            self.num_captures += 1
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out


class StepGraphs:
    """The runner's CUDA-graph state: the negotiated mode, the dispatcher, the padded
    metadata buffers and (on CUDA) the captured graphs.

    Args:
        builders: the runner's builders, one per cache group.
        names: per builder, the backend name (for the decision's reason).
        requested: the requested mode.
        device: the compute device.
        max_num_reqs, max_num_batched_tokens: the runner's limits.
        capture_sizes: default :data:`DEFAULT_CAPTURE_SIZES`.

    Attributes:
        decision: the :class:`GraphModeDecision` (``decision.reason`` says why).
        counts: steps so far by how they ran: ``"graph"`` (padded for a full graph;
            captured/replayed on CUDA), ``"eager"``.
    """

    def __init__(self, builders: Sequence[AttentionMetadataBuilder], names: Sequence[str],
                 requested: CUDAGraphMode | str | None, device: torch.device | str, max_num_reqs: int,
                 max_num_batched_tokens: int, capture_sizes: Sequence[int] | None = None):
        self.decision: GraphModeDecision = negotiate_cudagraph_mode(builders, requested, device, names)
        self.dispatcher = CUDAGraphDispatcher(self.decision.mode, capture_sizes or DEFAULT_CAPTURE_SIZES,
                                              max_num_reqs, max_num_batched_tokens)
        self.padded = PaddedMetadata(max_num_reqs, device)
        self.graphs = CUDAGraphRunner(device) if self.decision.capture else None
        self.counts = {"graph": 0, "eager": 0}

    @property
    def mode(self) -> CUDAGraphMode:
        return self.decision.mode

    def dispatch(self, num_scheduled_tokens) -> PaddedBatch:
        """The shape of the step whose per-row query lengths are ``num_scheduled_tokens``."""
        batch = self.dispatcher.dispatch(*batch_shape(num_scheduled_tokens))
        self.counts["graph" if batch.use_graph else "eager"] += 1
        return batch

    def common_metadata(self, common: Sequence[CommonAttentionMetadata], batch: PaddedBatch
                        ) -> list[CommonAttentionMetadata]:
        """The per-group metadata of the step, its requests padded for a graph step."""
        if not batch.use_graph:
            return list(common)
        return self.padded.pad(common, batch.num_reqs_padded)

    def forward(self, batch: PaddedBatch, forward: Callable[[], Any]) -> Any:
        """Run the step's forward: in its graph on CUDA for a graph step, else eagerly."""
        if batch.use_graph and self.graphs is not None:
            return self.graphs.run(batch.key, forward)
        return forward()
