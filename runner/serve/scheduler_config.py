"""``SchedulerConfig``: the limits of one scheduling step (vLLM's scheduler-config names)."""

from __future__ import annotations

from dataclasses import dataclass

from attnplug.core.errors import SchedulingError
from attnplug.runner.execute.spec_decode.drafter import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    Attributes:
        max_num_batched_tokens: token budget of a step (all requests together).
        max_num_seqs: most running requests at once.
        max_model_len: most tokens (prompt plus outputs) a request may hold.
        enable_chunked_prefill: split prompts longer than what is left of the budget
            across steps. Without it a new prompt is scheduled whole or waits.
        force_preemption_every: test hook: every this many steps, preempt the most
            recently admitted running request that has sampled at least one token and was
            never preempted (only while at least two requests run, so progress is
            guaranteed). ``None`` disables it.
        async_scheduling: allow one step in flight: ``schedule()`` plans the next step
            before the previous one's ``update_from_output``, assuming every request that
            samples in it gets its token (see ``Scheduler.schedule``).
        enable_prefix_caching: reuse cached blocks of equal prefixes at admission
            (``runner/serve/kv_cache_manager.py``): a request may start with
            ``num_computed_tokens > 0`` and blocks shared with other requests.
        speculative: speculative decoding (``--speculative ngram:k=3``): decoding requests
            verify up to ``k`` drafts a step (``runner/serve/spec_schedule.py``); ``None``
            disables it. Not with ``async_scheduling`` nor with Mamba groups.
        packed_deltas: hand the cached requests' drafts and block appends as arrays
            (``SchedulerOutput.packed_cached``, ``PackedCachedDeltas``: the step compiler's
            compiled scan reads them without a Python object per draft or append) instead
            of vLLM's ``scheduled_spec_decode_tokens`` and ``new_block_ids`` lists. ``None``
            (the default): when the compiled step kernels are available
            (``runner.step.kernels.kernels_available``; the numpy path converts the packed
            form back, which costs it ~15-70 µs a step). Never with a KV connector
            (connectors read ``new_block_ids``).

    Raises:
        SchedulingError: a limit that is not a positive int.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    force_preemption_every: int | None = None
    async_scheduling: bool = False
    enable_prefix_caching: bool = False
    speculative: SpeculativeConfig | None = None
    packed_deltas: bool | None = None

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SchedulingError(f"SchedulerConfig.{name} must be a positive int, got {v!r}")
        f = self.force_preemption_every
        if f is not None and (not isinstance(f, int) or f <= 0):
            raise SchedulingError(
                f"SchedulerConfig.force_preemption_every must be None or a positive int, got {f!r}")
