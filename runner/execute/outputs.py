"""What a step of ``ModelRunner`` returns: at once, or (asynchronous scheduling) later.

:class:`AsyncModelRunnerOutput` holds a step's sampled tokens while they are still on the
device; ``result()`` is the one place the engine waits for a step's outputs: it copies
them to the host (on CUDA the only device-to-host synchronisation of a steady step),
writes them over the step's placeholders in the token history
(``runner/step/placeholders.py``) and returns the :class:`ModelRunnerOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from attnplug.runner.step.placeholders import Placeholders


@dataclass
class ModelRunnerOutput:
    """What one step produced.

    Attributes:
        req_ids: the step's requests in batch-row order.
        sampled_token_ids: ``{req_id: [token]}`` for rows that were not discarded (partial
            prefills and recomputes produce nothing).
        logits: ``{req_id: [vocab_size] float32 CPU}`` for the same rows, when the runner
            was created with ``record_logits=True``.
        kv_connector_output: with a KV connector, its loads that ended in the step
            (``core/kv_connector.py``'s ``KVConnectorOutput``), else ``None``.
    """

    req_ids: list[str]
    sampled_token_ids: dict[str, list[int]]
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_connector_output: Any = None


class AsyncModelRunnerOutput:
    """One step's outputs, not read back yet (``ModelRunner.execute_model_async``).

    Args:
        runner: the ``ModelRunner`` that ran the step.
        req_ids: the step's requests in batch-row order.
        placeholders: the sampling requests and their placeholders' positions.
        token_ids: ``[n]`` ``int64`` sampled tokens on the device, in ``placeholders`` order.
        logits: ``{req_id: [vocab_size] float32 CPU}`` when the runner records logits.
    """

    def __init__(self, runner: Any, req_ids: list[str], placeholders: Placeholders | None,
                 token_ids: torch.Tensor | None, logits: dict[str, torch.Tensor]):
        self._runner = runner
        self.req_ids = req_ids
        self._placeholders = placeholders
        self._token_ids = token_ids
        self._logits = logits
        self._result: ModelRunnerOutput | None = None

    @classmethod
    def empty(cls, runner: Any) -> AsyncModelRunnerOutput:
        """The output of a step that scheduled nothing."""
        return cls(runner, [], None, None, {})

    def result(self) -> ModelRunnerOutput:
        """Wait for the tokens, fill the host history, return the step's output (cached:
        a second call returns the same object and waits for nothing)."""
        if self._result is None:
            sampled: dict[str, list[int]] = {}
            if self._placeholders is not None and self._placeholders.req_ids:
                self._runner.num_output_waits += 1
                t0 = time.perf_counter_ns()
                tokens = self._token_ids.cpu().tolist()  # the wait
                self._runner.output_wait_ns += time.perf_counter_ns() - t0
                self._runner.compiler.fill_output_tokens(self._placeholders, tokens)
                sampled = {rid: [tok] for rid, tok in zip(self._placeholders.req_ids, tokens)}
            self._result = ModelRunnerOutput(self.req_ids, sampled, self._logits)
            self._runner._result_read(self)
        return self._result
