"""What the scheduler sends the runner each step: deltas, not full state.

Mirrors vLLM V1's ``SchedulerOutput`` / ``NewRequestData`` / ``CachedRequestData``.
``scheduled_new_reqs`` carry a request's full start state; ``scheduled_cached_reqs``
carry only what changed for a request the runner already holds.

The typing rule (``StepCompiler.update_states`` applies it, the same on its compiled and
numpy paths; anything else is ``InvalidSchedulerOutput`` naming the request and field,
and changes nothing):

* request ids are ``str``, or a ``str`` subclass such as ``numpy.str_`` (an id read out of a
  numpy array), looked up by its value; the runner keeps a new request's id as a plain
  ``str`` (``check.types.request_id``); ``bytes``, ints and ``None`` are refused;
* integer fields (counts, ``num_computed_tokens``, token and block ids) are ``int`` or
  numpy integer scalars — never ``bool`` (of any kind: a one-element bool tensor too),
  ``float`` or ``str`` (``True`` is not 1 and
  ``5.0`` is not 5: earlier versions took both on some paths);
* integer lists are ``list`` or ``tuple`` of those, or 1-D numpy arrays of an integer
  dtype (not 0-d, not bool/float/str arrays);
* flags (``resumed_from_preemption``) are ``bool`` (or ``numpy.bool_``);
* containers are the documented types: ``list``/``tuple`` of ``NewRequestData``, a
  ``CachedRequestData`` whose five fields are lists of equal length, a ``dict`` for
  ``num_scheduled_tokens``, a ``set`` (or list/tuple) of ids for ``finished_req_ids``.

Drafts and block appends may also come packed (:class:`PackedCachedDeltas`, the field
``SchedulerOutput.packed_cached``): flat ``int32`` arrays aligned with
``scheduled_cached_reqs.req_ids`` instead of a dict of lists and a list of tuples of
lists. Both forms give the same plan and the same errors (an error found in the packed
arrays names ``packed_cached.<field>``).

Every field is read once per ``update_states`` (``runner/step/check/snapshot.py``), and
the runner keeps no reference to the caller's lists afterwards: changing them later
changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attnplug.core.errors import InvalidSamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from attnplug.runner.step.mrope import PlaceholderRange
    from attnplug.runner.step.multimodal import MultiModalFeature


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` is greedy.

    ``top_k <= 0`` disables top-k; ``top_p >= 1`` disables top-p. ``seed`` makes a
    request's sampling reproducible whatever batch it runs in. A request finishes after
    ``max_tokens`` outputs, or after sampling one of ``stop_token_ids`` (an EOS; the stop
    token is the last output, as vLLM keeps it unless told otherwise).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Refuse ``max_tokens`` that is not an int ``>= 1`` (vLLM's ``SamplingParams``
        refuses ``< 1`` too); the other fields are checked where a request enters (stage 1,
        ``Scheduler.add_request``), with its id in the message.

        Raises:
            InvalidSamplingParams: ``max_tokens`` is not an int, or ``< 1``.
        """
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise InvalidSamplingParams(f"SamplingParams: max_tokens must be an int >= 1, got {mt!r}")


@dataclass
class NewRequestData:
    """A request entering the runner (first schedule, or re-sent in full).

    Attributes:
        req_id: unique request id.
        prompt_token_ids: the prompt's token ids.
        block_ids: per cache group, the manager block ids allocated so far (logical order).
        num_computed_tokens: tokens whose K/V is already cached (prefix-cache hits).
        sampling_params: sampling settings.
        output_token_ids: tokens already generated (non-empty only when a preempted
            request is re-sent in full).
        prompt_embeds: ``None``, or the prompt's input embeddings, ``[num_prompt_tokens,
            hidden_size]`` in the model dtype (vLLM's ``--enable-prompt-embeds``): the
            model reads row ``i`` instead of embedding ``prompt_token_ids[i]`` (which then
            only fix the prompt length; any ids in range, e.g. 0). Only a step compiler
            built with a ``PromptEmbedsConfig`` takes them; it copies them once (the
            caller's tensor is not kept) and keeps them until the request finishes, so a
            recompute after preemption reads them again. See docs/embedding.md.
        mm_placeholders: ``None``, or the prompt's image spans, in order
            (``runner/step/mrope.py``'s ``PlaceholderRange``: offset and the image's grid
            ``(t, h, w)``); a compiler built with ``uses_mrope=True`` computes the
            request's M-RoPE positions from them (``StepInputs.mrope_positions``).
        mm_features: ``None``, or the prompt's images in order (``runner/step/multimodal.py``'s
            ``MultiModalFeature``: pixel values, patch grid, content hash, placeholder span);
            a compiler built with a ``MultiModalConfig`` keeps them until the request
            finishes and lists each step's placeholder slices (``StepInputs.mm_slices``);
            they also give the M-RoPE spans (``mm_placeholders`` must then be ``None``).
    """

    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    prompt_embeds: "torch.Tensor | None" = None
    mm_placeholders: "list[PlaceholderRange] | None" = None
    mm_features: "list[MultiModalFeature] | None" = None


@dataclass
class CachedRequestData:
    """Per-step changes of requests the runner already holds, column-wise.

    Entry i of every list belongs to ``req_ids[i]``.

    Attributes:
        req_ids: the requests.
        resumed_from_preemption: True → ``new_block_ids`` REPLACE the request's block ids
            (it was preempted and its blocks freed); False → they are appended.
        new_token_ids: tokens appended to the request since its last step (sampled
            outputs the runner does not know yet; usually empty, because the runner
            appends its own samples).
        new_block_ids: per request, per cache group, block ids to append (or the full
            list when resumed); ``None`` means no change.
        num_computed_tokens: per request, tokens already cached before this step.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls()

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class PackedCachedDeltas:
    """The cached requests' drafts and block appends as arrays (the form
    ``runner/serve/scheduler.py`` produces), aligned with ``scheduled_cached_reqs.req_ids``:
    entry ``i`` of a count array belongs to ``req_ids[i]``. Data only; ``update_states``
    reads each field once and keeps no reference to the arrays.

    It replaces, for the step compiler, ``SchedulerOutput.scheduled_spec_decode_tokens``
    and the appends of ``CachedRequestData.new_block_ids``: with it, the dict must be empty
    and ``new_block_ids[i]`` ``None`` for every request that is not resumed (a resumed
    request's replacement lists stay in ``new_block_ids``; its counts here must be 0).
    Every array is a C-contiguous numpy array of dtype ``int32`` (anything else:
    ``InvalidSchedulerOutput`` naming ``packed_cached.<field>``); the values follow the
    rules of the fields they replace (drafts in ``[0, 2**31)``, block ids in the group's
    pool, counts ``>= 0``).

    Attributes:
        num_draft_tokens: ``[num_cached]`` ``int32``: drafts request ``i`` verifies this
            step (0: none; ``d >= 1``: a decoding request scheduled ``1 + d`` tokens, as
            ``scheduled_spec_decode_tokens``).
        draft_token_ids: ``[sum(num_draft_tokens)]`` ``int32``: the drafts, request after
            request in ``req_ids`` order.
        num_new_blocks: ``[G, num_cached]`` ``int32`` (``G`` cache groups): blocks request
            ``i`` appends in group ``g`` (a decode step: mostly 0, 1 where a row crosses a
            block boundary).
        new_block_ids: ``[num_new_blocks.sum()]`` ``int32``: the appended manager block ids,
            group-major (group 0's appends in ``req_ids`` order, then group 1's, ...).
    """

    num_draft_tokens: "np.ndarray"
    draft_token_ids: "np.ndarray"
    num_new_blocks: "np.ndarray"
    new_block_ids: "np.ndarray"


@dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled_new_reqs: requests the runner sees for the first time (or again in full).
        scheduled_cached_reqs: changes of resident requests.
        num_scheduled_tokens: ``{req_id: tokens to compute this step}`` for every scheduled
            request (new and cached). Resident requests absent from it are *unscheduled*:
            they leave the batch but keep their state.
        total_num_scheduled_tokens: ``sum(num_scheduled_tokens.values())``.
        finished_req_ids: requests to forget (their state is dropped).
        mamba_state_copies: prefix caching with Mamba groups: the step's state-slot copies
            (``runner/serve/mamba_checkpoints.py``'s ``MambaStateCopies``: restores before
            the forward, saves after), or ``None``. The step compiler does not read it.
        scheduled_spec_decode_tokens: ``{req_id: [draft token ids]}`` (vLLM's name) for the
            requests that verify drafts this step (speculative decoding). A request with
            ``d`` drafts is a decoding cached request with exactly one real token left to
            compute, scheduled ``1 + d`` tokens: that token, then the drafts (which the
            runner writes after the request's last token, ``spec_token_ids``). Empty
            lists mean no drafts. See ``runner/step/check/spec.py`` for the checks.
        kv_connector_metadata: the step's KV connector work (loads, saves), built by the
            scheduler-side connector for the worker side (``core/kv_connector.py``), or
            ``None``. The step compiler does not read it.
        packed_cached: ``None``, or the cached requests' drafts and block appends as
            arrays (:class:`PackedCachedDeltas`), in place of ``scheduled_spec_decode_tokens``
            and the appends of ``scheduled_cached_reqs.new_block_ids``.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    mamba_state_copies: object | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_metadata: object | None = None
    packed_cached: PackedCachedDeltas | None = None

    def __post_init__(self):
        if not self.total_num_scheduled_tokens and self.num_scheduled_tokens:
            self.total_num_scheduled_tokens = sum(self.num_scheduled_tokens.values())
