"""Speculative decoding in the scheduler: drafts per decoding request, rollback after the step.

vLLM V1's semantics, our code:

* **Scheduling** (:meth:`SpecScheduler.propose`): a running request with exactly one token
  left to compute (a decode) gets up to ``k`` drafts from the drafter (its history: prompt
  plus outputs), capped so that its ``1 + d`` tokens fit the step's remaining budget and
  the ``1 + d`` tokens it may emit fit ``max_tokens`` / ``max_model_len``
  (``d <= remaining_output_tokens - 1``). It is scheduled ``1 + d`` tokens, blocks are
  allocated for that optimistic length, and the drafts go out in
  ``SchedulerOutput.packed_cached`` (``PackedCachedDeltas.num_draft_tokens`` /
  ``draft_token_ids``; ``scheduled_spec_decode_tokens`` when the scheduler sends vLLM's
  form: ``SchedulerConfig.packed_deltas``). ``drafts_by_id`` below: the step's drafts in vLLM's form
  (``runner/step/packed_deltas.py``'s ``draft_tokens``).
* **Rollback** (:meth:`SpecScheduler.computed_advance`): after the step a request that
  verified ``d`` drafts and emitted ``a + 1`` tokens advances ``num_computed_tokens`` by
  ``1 + d - (d - a) = a + 1`` (scheduled, minus the rejected drafts), so the next step's
  cached delta carries the corrected count and recomputes nothing that was accepted. Its
  blocks stay: they cover positions the next steps fill (vLLM keeps them too); a
  sliding-window group frees only blocks before the *rolled back* count.
* **Refused configurations** (:func:`check_spec_config`, at construction): asynchronous
  scheduling (drafts need the previous step's tokens on the host) and state groups whose
  requests hold fewer than ``1 + k`` slots (``KVCacheConfig.state_slots_per_request``: the
  request's state plus one scratch slot per draft position, docs/speculative-decoding.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.cache_groups.kinds import GroupKind
from attnplug.core.errors import ConfigError, SchedulingError
from attnplug.runner.execute.spec_decode.drafter import SpeculativeConfig
from attnplug.runner.serve.request import Request
from attnplug.runner.step.scheduler_output import SchedulerOutput


def check_spec_config(spec: SpeculativeConfig, async_scheduling: bool, kv_cache_config: KVCacheConfig) -> None:
    """Refuse what speculative decoding cannot serve (one line, ``ConfigError``): asynchronous
    scheduling, and state groups whose requests hold fewer than ``1 + k`` state slots (the
    request's state plus one scratch slot per draft position,
    ``KVCacheConfig.state_slots_per_request``)."""
    if async_scheduling:
        raise ConfigError("--speculative", "speculative decoding needs synchronous scheduling "
                          "(drafts are proposed from the previous step's tokens); drop --async-scheduling")
    state = [g for g, grp in enumerate(kv_cache_config.groups) if grp.kv_cache_spec.kind is GroupKind.MAMBA]
    need = 1 + spec.k
    if state and kv_cache_config.state_slots_per_request < need:
        raise ConfigError("--speculative", f"state groups {state} hold {kv_cache_config.state_slots_per_request} "
                          f"state slot(s) per request but k={spec.k} drafts need {need} (the request's state "
                          "plus one per draft position): set KVCacheConfig.state_slots_per_request")


def make_spec_scheduler(config, kv_cache_config: KVCacheConfig) -> "SpecScheduler | None":
    """The scheduler's speculative part for ``config`` (a ``SchedulerConfig``), or ``None``.

    Raises:
        ConfigError: as :func:`check_spec_config`.
    """
    if config.speculative is None:
        return None
    check_spec_config(config.speculative, config.async_scheduling, kv_cache_config)
    return SpecScheduler(config.speculative, config.max_model_len)


@dataclass
class SpecStats:
    """Counters of speculative decoding over an engine's life.

    Attributes:
        num_draft_tokens: drafts proposed (and verified).
        num_accepted_tokens: drafts accepted.
        num_verifications: (request, step) pairs that verified at least one draft.
    """

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (0 with none)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: ``1 + accepted / verifications`` (vLLM's mean
        acceptance length; 0 with none)."""
        return 1.0 + self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0


class SpecScheduler:
    """The scheduler's speculative-decoding part (one per ``Scheduler``).

    Args:
        spec: the parsed ``--speculative`` configuration.
        max_model_len: the scheduler's ``max_model_len``.
    """

    def __init__(self, spec: SpeculativeConfig, max_model_len: int):
        self.spec = spec
        self.drafter = spec.make_drafter()
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._history: dict[str, tuple[np.ndarray, int]] = {}
        """Per request, its tokens as ``int64`` (a buffer of ``max_model_len``) and how many
        are filled: extended by the new outputs each step, so the drafter never converts the
        whole Python list again (dropped when the request can emit at most one more token)."""

    def _tokens(self, req: Request) -> np.ndarray:
        buf, n = self._history.get(req.req_id, (None, 0))
        if buf is None:
            buf = np.empty(self.max_model_len, dtype=np.int64)
        total = req.num_tokens
        if n < total:
            P = req.num_prompt_tokens
            if n < P:
                buf[n:P] = req.prompt_token_ids[n:]
                n = P
            buf[n:total] = req.output_token_ids[n - P:total - P]
        self._history[req.req_id] = (buf, total)
        return buf[:total]

    def propose(self, req: Request, budget: int) -> list[int]:
        """Drafts for ``req`` this step (empty unless it decodes and there is room).

        Args:
            req: a running request.
            budget: tokens left in this step's budget (before ``req``).
        """
        if req.num_tokens_to_compute != 1 or req.num_output_placeholders:
            return []
        remaining = req.remaining_output_tokens(self.max_model_len)
        if remaining <= 1:
            self._history.pop(req.req_id, None)  # finishing: no more drafts for it
            release = getattr(self.drafter, "release", None)  # a drafter with per-request state
            if release is not None:
                release(req.req_id)
            return []
        k = min(self.spec.k, budget - 1, remaining - 1)
        if k <= 0:
            return []
        return self.drafter.propose([self._tokens(req)], k, req_ids=[req.req_id])[0]

    def check_sampled(self, drafts_by_id: dict[str, list[int]], sampled: dict[str, list[int]]) -> None:
        """Before ``update_from_output`` changes anything: a request that verified ``d``
        drafts must emit ``1 .. 1 + d`` tokens.

        Raises:
            SchedulingError: naming the request.
        """
        for rid, drafts in drafts_by_id.items():
            toks = sampled.get(rid)
            if toks is not None and len(toks) > 1 + len(drafts):
                raise SchedulingError(f"{rid!r} verified {len(drafts)} drafts but got {len(toks)} tokens "
                                      f"(at most 1 + drafts)")

    def computed_advance(self, drafts_by_id: dict[str, list[int]], req_id: str, n: int, toks: list[int] | None) -> int:
        """How far ``req_id`` advances ``num_computed_tokens``: ``n`` scheduled tokens minus
        its rejected drafts (``d - (len(toks) - 1)``); counts the drafts in :attr:`stats`."""
        drafts = drafts_by_id.get(req_id)
        if not drafts:
            return n
        accepted = len(toks) - 1 if toks else 0
        self.stats.num_draft_tokens += len(drafts)
        self.stats.num_accepted_tokens += accepted
        self.stats.num_verifications += 1
        return n - (len(drafts) - accepted)
