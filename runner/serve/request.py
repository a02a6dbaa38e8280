"""The scheduler's view of one request: its tokens, progress, status and blocks.

The runner keeps its own copy (``CachedRequestState``); the two agree because the
scheduler sends every change as a ``SchedulerOutput`` delta
(``attnplug.runner.step.scheduler_output``). Field names follow vLLM V1's ``Request``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from attnplug.runner.step.scheduler_output import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle: ``WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED``; with a KV
    connector ``WAITING -> WAITING_FOR_REMOTE_KVS -> WAITING -> RUNNING ...``."""

    WAITING = "waiting"
    """Added, never scheduled yet."""
    RUNNING = "running"
    """Admitted: owns blocks, scheduled every step the budget allows."""
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """Blocks allocated, its KV loading through the connector; not scheduled for compute."""
    PREEMPTED = "preempted"
    """Blocks freed and ``num_computed_tokens`` reset; waits to be recomputed."""
    FINISHED = "finished"
    """Produced ``max_tokens`` outputs or reached ``max_model_len``; blocks freed."""


@dataclass(eq=False)
class Request:
    """One request as the scheduler tracks it.

    Attributes:
        req_id: unique id.
        prompt_token_ids: the prompt (never empty).
        sampling_params: sampling settings; ``max_tokens`` ends the request.
        arrival_index: order of ``add_request`` calls (0, 1, ...): FIFO order of admission.
        output_token_ids: sampled tokens so far.
        num_computed_tokens: tokens whose K/V is cached (units: tokens; reset to 0 by
            preemption).
        status: see :class:`RequestStatus`.
        block_ids: per cache group, the manager block ids the request owns, logical order
            (empty lists while it owns none).
        num_preemptions: times this request was preempted.
        sent_to_runner: the runner holds this request's state (set when first scheduled;
            it stays set across preemption, because the runner keeps the state of
            unscheduled requests, and is cleared only when the request finishes).
        num_output_placeholders: asynchronous scheduling: outputs of in-flight steps whose
            values are not known yet (counted in ``num_tokens``).
        steps_in_flight: in-flight steps that scheduled the request (its blocks are freed
            only when this is 0).
        free_when_idle: finished or preempted while a step that uses its blocks is in
            flight: free them when ``steps_in_flight`` reaches 0.
        stopped: sampled one of ``sampling_params.stop_token_ids``.
        prompt_embeds: ``None``, or the prompt as embeddings ``[len(prompt_token_ids),
            hidden_size]`` (sent with the request's first ``NewRequestData``; such a
            request never shares prefix-cache blocks).
        kv_load: the KV connector's load of this request: ``None`` (never asked),
            ``"loading"``, ``"loaded"``, ``"failed"`` or ``"dropped"`` (``runner/serve/kv_loads.py``).
        kv_load_tokens: tokens that load brings beyond the local prefix hit.
        mm_features: ``None``, or the prompt's images (``runner/step/multimodal.py``'s
            ``MultiModalFeature``; sent with the first ``NewRequestData``); their content
            hashes enter the hashes of the blocks their spans overlap (prefix caching).
        kv_remote_tokens: leading ``output_token_ids`` another instance sampled (a KV
            connector's ``take_remote_output_tokens``: a disaggregated prefill), not this one.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: tuple[list[int], ...] = ()
    num_preemptions: int = 0
    sent_to_runner: bool = False
    num_output_placeholders: int = 0
    steps_in_flight: int = 0
    free_when_idle: bool = False
    stopped: bool = False
    prompt_embeds: Any = None
    kv_load: str | None = None
    kv_load_tokens: int = 0
    mm_features: Any = None
    kv_remote_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """All tokens the request holds: prompt plus outputs so far (and, with asynchronous
        scheduling, the outputs of in-flight steps)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (a new list)."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens_to_compute(self) -> int:
        """``num_tokens - num_computed_tokens``: what is left before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing the prompt (or, after preemption, prompt plus outputs)."""
        return self.num_tokens_to_compute > 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def remaining_output_tokens(self, max_model_len: int) -> int:
        """Tokens it may still sample: bounded by ``max_tokens`` and by ``max_model_len``
        (in-flight outputs count); 0 once it sampled a stop token."""
        if self.stopped:
            return 0
        return max(0, min(self.sampling_params.max_tokens - self.num_output_tokens - self.num_output_placeholders,
                          max_model_len - self.num_tokens))
