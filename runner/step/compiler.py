"""``StepCompiler``: scheduler deltas in, one step's flat inputs and metadata out.

It owns the runner's persistent request state — ``requests`` (object view,
:class:`CachedRequestState`) and ``input_batch`` (columnar view, :class:`InputBatch`) —
and nothing model-specific, so a model runner composes it:

.. code-block:: python

    sc.update_states(scheduler_output)             # validate, then apply the deltas
    inputs = sc.prepare_inputs(scheduler_output)   # tokens, positions, metadata per group
    hidden = model(inputs.input_ids, inputs.positions, ...)   # builders read
    #        inputs.common_attn_metadata[g] for cache group g
    keep = ~inputs.discard                         # partial prefills produce no token
    sc.append_output_tokens([inputs.req_ids[i] for i in np.flatnonzero(keep)], sampled)

The scheduler never re-sends the runner's own samples: ``append_output_tokens`` is how
they enter the token history. Everything ``prepare_inputs`` returns is a view of a
persistent buffer, valid until the next ``update_states``.

This class is a façade over the stages, one module each, in the order a step runs:
``check`` (stage 1: validate, change nothing) → ``apply`` (stage 2) → ``prepare``
(stage 3) → ``common_metadata`` (stage 4) → … → ``append`` (stage 8); the layout of the
cache groups is ``groups.StepLayout``; the loops run on the step's kernels
(``step_kernels.py``: numpy, or compiled from ``fast/``), chosen once here.

With ``ATTNPLUG_VALIDATE=1`` (read at construction) ``prepare_inputs`` checks the eight
invariants (``attnplug.core.validate``) for every cache group each step.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.cache_groups.kinds import PAGED_FULL_KINDS, GroupKind
from attnplug.core import switches
from attnplug.core.devices import resolve_device
from attnplug.core.errors import MetadataError
from attnplug.core.validation import BatchView, validate
from attnplug.runner.step.append import append_output_tokens
from attnplug.runner.step.apply import apply_update
from attnplug.runner.step.check.checker import UpdateChecker
from attnplug.runner.step.check.types import is_bool_like
from attnplug.runner.step.common_metadata import build_common_attn_metadata
from attnplug.runner.step.debug import batch_view, snapshot, snapshot_diff
from attnplug.runner.step.kernels import choose_kernels
from attnplug.runner.step.groups import StepLayout, StepLimits
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.placeholders import (Placeholders, append_placeholders, fill_output_tokens, finish_patch,
                                               prev_tokens_tensor)
from attnplug.runner.step.plan import UpdatePlan
from attnplug.runner.step.prepare import InputPreparer, StepInputs
from attnplug.runner.step.mrope import MRopeStore
from attnplug.runner.step.multimodal import MultiModalConfig, MultiModalStore
from attnplug.runner.step.prompt_embeds import PromptEmbedsConfig, PromptEmbedsStore
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import SamplingParams, SchedulerOutput
from attnplug.runner.step.spec_apply import append_verified_tokens
from attnplug.runner.step.spec_metadata import spec_decode_metadata
from attnplug.runner.step.step_size import check_step_size, expected_tokens


__all__ = ["StepCompiler", "snapshot_diff"]


class StepCompiler:
    """Validates and applies scheduler outputs; prepares each step's inputs.

    Args:
        block_sizes: manager block size per cache group, or a :class:`KVCacheConfig`
            (then block sizes, ``num_blocks`` and group kinds come from it).
        max_num_reqs: most requests in one step (batch rows).
        max_model_len: most tokens a request may hold.
        max_num_batched_tokens: most tokens in one step.
        device: where device tensors live (``"cpu"``: host buffers are used directly).
        kernel_block_sizes: per group, the kernel block size (divides the manager size).
        reorder_batch_threshold: if set, rows with ``num_scheduled_tokens <= threshold``
            are moved before the others each step (decodes first).
        num_blocks: blocks per group's pool (valid ids ``[1, num_blocks)``); default: any
            id whose kernel expansion fits ``int32``.
        group_kinds: per group a :class:`~attnplug.cache_groups.kinds.GroupKind` or its
            name: ``"full_attention"`` (default), ``"sliding_window"`` (the null block is
            legitimate in a request's initial or replacement block list) or ``"mamba"``
            (one state block per request; no slot mapping).
        validate: run ``attnplug.core.validate`` every step; ``None`` reads
            ``ATTNPLUG_VALIDATE=1`` from the environment.
        sliding_windows: per group, the window ``W`` (tokens) of a ``"sliding_window"``
            group, ``None`` otherwise. Given a window, the compiler nulls the blocks no
            query can see in the group's block table each step, as the block pool frees
            them (``runner/step/apply_windows.py``); without one it keeps whatever ids the
            scheduler sent. Default: from the specs of a :class:`KVCacheConfig`, else none.
        native: use the compiled fast paths (``runner.step.fast``) when they are built;
            ``None`` (default) uses them unless ``ATTNPLUG_NATIVE=0``. Results are the
            same either way; ``False`` runs the numpy paths only.
        prompt_embeds: a :class:`~attnplug.runner.step.prompt_embeds.PromptEmbedsConfig`
            (hidden size, model dtype) to take ``NewRequestData.prompt_embeds``; ``None``
            (default) refuses them. Steps that schedule their prompt positions then carry
            ``StepInputs.inputs_embeds`` / ``is_embed`` (``runner/step/prompt_embeds.py``).
        uses_mrope: compute ``StepInputs.mrope_positions`` (``[3, P]``) every step, from
            the new requests' ``mm_placeholders`` or ``mm_features`` (``runner/step/mrope.py``); ``False``
            (default) refuses placeholders.
        multimodal: a :class:`~attnplug.runner.step.multimodal.MultiModalConfig` to take
            ``NewRequestData.mm_features`` (images): kept per request until it finishes;
            each step with placeholder tokens lists them in ``StepInputs.mm_slices``
            (``runner/step/multimodal.py``); ``None`` (default) refuses images.

    Attributes:
        layout: the :class:`~attnplug.runner.step.groups.StepLayout` (groups, limits).
        checker: stage 1, :class:`~attnplug.runner.step.check.UpdateChecker`.
        requests: ``{req_id: CachedRequestState}``, every request the runner holds
            (scheduled or not).
        input_batch: the rows of the current step.

    Raises:
        KVCacheSpecError: inconsistent group configuration.
    """

    def __init__(self, block_sizes: Sequence[int] | KVCacheConfig, max_num_reqs: int, max_model_len: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu",
                 kernel_block_sizes: Sequence[int] | None = None,
                 reorder_batch_threshold: int | None = None, *, num_blocks: int | None = None,
                 group_kinds: Sequence[str] | None = None, validate: bool | None = None,
                 sliding_windows: Sequence[int | None] | None = None, native: bool | None = None,
                 prompt_embeds: PromptEmbedsConfig | None = None, uses_mrope: bool = False,
                 multimodal: MultiModalConfig | None = None):
        lay = self.layout = StepLayout.from_args(
            block_sizes, StepLimits(max_num_reqs, max_model_len, max_num_batched_tokens),
            kernel_block_sizes=kernel_block_sizes, num_blocks=num_blocks, group_kinds=group_kinds,
            sliding_windows=sliding_windows)
        """The cache groups and limits (``runner/step/groups.py``)."""
        # the layout's facts, as attributes (public names of this class)
        self.block_sizes, self.num_groups = lay.block_sizes, lay.num_groups
        self.kernel_block_sizes, self.group_kinds = lay.kernel_block_sizes, lay.group_kinds
        self.null_block_allowed, self.sliding_windows = lay.null_block_allowed, lay.sliding_windows
        self.has_sliding_windows = lay.has_sliding_windows
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_blocks_per_group = lay.num_blocks_per_group
        """Valid block ids of group g are ``[1, num_blocks_per_group[g])`` (Mamba groups: state slots)."""
        self.num_blocks = lay.num_blocks
        """The smallest pool: ids below it are valid in every group (the fast path's check)."""
        self.max_num_blocks_per_req = lay.max_num_blocks_per_req
        self.reorder_batch_threshold = reorder_batch_threshold
        self.device = resolve_device(device)
        kernels = self.kernels = choose_kernels(native, SamplingParams)
        """The step's loops (``runner/step/step_kernels.py``): compiled when built and not refused."""
        self.native = kernels.name == "compiled"
        """Whether the compiled kernels run (``runner/step/fast/``)."""
        self.input_batch = InputBatch(max_num_reqs, max_model_len, max_num_batched_tokens, self.block_sizes,
                                      self.device, self.kernel_block_sizes, kernels)
        self.requests: dict[str, CachedRequestState] = {}
        self.checker = UpdateChecker(lay, self.input_batch, self.requests, kernels)
        """Stage 1 (``runner/step/check/checker.py``): ``checker.plan(scheduler_output)``."""
        self.checker.prompt_embeds_config = prompt_embeds
        self.prompt_embeds: PromptEmbedsStore | None = (
            None if prompt_embeds is None else PromptEmbedsStore(prompt_embeds, max_num_batched_tokens, self.device))
        """The kept prompt embeddings and the ``inputs_embeds`` buffers (``None``: not enabled)."""
        self.checker.uses_mrope = bool(uses_mrope)
        self.mrope: MRopeStore | None = MRopeStore(max_num_batched_tokens, self.device) if uses_mrope else None
        self.checker.mm_config = multimodal
        self.mm: MultiModalStore | None = MultiModalStore() if multimodal is not None else None
        """The M-RoPE prompt positions of resident requests with images (``None``: not enabled)."""
        self._preparer = InputPreparer(max_num_reqs, max_model_len, max_num_batched_tokens, self.device, kernels)
        self.validate = switches.flag("ATTNPLUG_VALIDATE") if validate is None else bool(validate)

    @property
    def patch_counts(self) -> dict[str, int]:
        """Asynchronous scheduling: how many steps' ``input_ids`` took the previous step's
        device tokens by one slice copy (``"slice"``), or by a scatter (``"scatter"``: rows
        moved); counted by the kernels in ``PrepareBuffers.patch_steps``."""
        slice_steps, scatter_steps = self._preparer.buffers.patch_steps.tolist()
        return {"slice": slice_steps, "scatter": scatter_steps}

    # --- the step -----------------------------------------------------------------------
    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Validate ``scheduler_output`` in full (stage 1), then apply it (stage 2).

        Raises:
            InvalidSchedulerOutput: unknown or duplicate request ids, a new request that is
                already resident, negative or oversized counts, inconsistent
                ``num_computed_tokens``, block ids outside the pool (or null where it is not
                legitimate), more tokens than ``max_num_batched_tokens`` or
                ``max_model_len``, a block table too short for ``seq_lens``, unknown
                finished ids. The state is then exactly as before the call.
        """
        self.apply(self.checker.plan(scheduler_output))

    def apply(self, plan: UpdatePlan) -> None:
        """Stage 2: apply a plan that ``self.checker.plan`` returned for this state."""
        apply_update(self.layout, self.input_batch, self.requests, plan, self.reorder_batch_threshold)
        if self.prompt_embeds is not None:
            self.prompt_embeds.update(plan.finished, plan.prompt_embeds)
        if self.mrope is not None:
            self.mrope.update(plan.finished, plan.mm_placeholders)
        if self.mm is not None:
            self.mm.update(plan.finished, plan.mm_features)

    def prepare_inputs(self, scheduler_output: SchedulerOutput | None = None,
                       num_tokens_padded: int | None = None, *, build_metadata: bool = True,
                       prev_token_ids: torch.Tensor | None = None) -> StepInputs:
        """The step's inputs for the rows ``update_states`` left (see ``runner.step.prepare``).

        Args:
            scheduler_output: the output just applied (checked for the token count only).
            num_tokens_padded: pad the token dimension to this many (an int, never a ``bool``;
                ``>= num_actual_tokens``, ``<= max_num_batched_tokens``).
            build_metadata: also build ``common_attn_metadata`` (one per group).
            prev_token_ids: asynchronous scheduling: the previous step's sampled tokens, a
                1-D integer ``torch.Tensor`` ``[n]`` (not ``bool``; on the step's device or the
                CPU), one per placeholder the latest :meth:`append_placeholders` appended
                (``n`` exactly: a tensor with an entry per batch row would be read at the
                wrong entries), in the order it got them; the placeholders
                among this step's ``input_ids`` are overwritten from it
                (``runner/step/placeholders.py``). The first successful call of a step
                consumes the patch: a second one, or one without ``prev_token_ids`` while
                placeholders are pending, is refused (call :meth:`fill_output_tokens` to
                prepare from the history). On a CPU device each token taken is checked in
                ``[0, 2**31)``; a tensor on another device is not read on the host.

        Returns:
            :class:`StepInputs`; its tensors are views valid until the next ``update_states``.
            On CUDA the device tensors are filled by non-blocking copies out of pinned host
            buffers that the next step rewrites: a caller must let those copies run before
            its next ``update_states`` (``ModelRunner`` waits on a ``HostBufferFence``).

        Raises:
            InvalidSchedulerOutput: ``scheduler_output`` is not the one just applied (its
                ``total_num_scheduled_tokens`` is not the step's count, or not an int).
            MetadataError: a bad ``num_tokens_padded``; a ``prev_token_ids`` that is not a
                1-D integer tensor, whose length is not the latest ``append_placeholders``'
                count, or which holds a token outside ``[0, 2**31)``; a placeholder among the
                step's tokens that nothing patches. Nothing is consumed then.
            MetadataInvariantError: with validation on, a broken invariant.
        """
        b = self.input_batch
        if num_tokens_padded is not None:
            try:
                if is_bool_like(num_tokens_padded):  # (operator.index takes True, and a bool tensor, as 1)
                    raise TypeError
                num_tokens_padded = operator.index(num_tokens_padded)
            except TypeError:
                raise MetadataError(f"num_tokens_padded must be an int, got {num_tokens_padded!r}") from None
        expected, cap = expected_tokens(scheduler_output), self.max_num_batched_tokens
        prev_host = -1 if prev_token_ids is None else self.kernels.host_tokens(prev_token_ids, b.num_prev_sampled)
        if prev_host < 0 and prev_token_ids is not None:  # (the usual CPU tensor passed in one call)
            prev_token_ids = prev_tokens_tensor(prev_token_ids, self.device, b.num_prev_sampled)
        if num_tokens_padded is not None and not 0 <= num_tokens_padded <= self.max_num_batched_tokens:
            check_step_size(expected, int(b.num_scheduled_tokens[:b.num_reqs].sum()), num_tokens_padded, cap)
        # the kernels count the tokens as they go: check the count afterwards (they write
        # only the step's output buffers; the async patch consumes its columns only for a
        # step that passes the check)
        if prev_token_ids is None:
            inputs = self._preparer.prepare(b, self.group_kinds, num_tokens_padded)
            check_step_size(expected, inputs.num_actual_tokens, num_tokens_padded, cap)
        else:
            prep = self._preparer
            inputs = prep.prepare(b, self.group_kinds, num_tokens_padded, prev_token_ids, expected, prev_host)
            check_step_size(expected, inputs.num_actual_tokens, num_tokens_padded, cap)
            patch = prep.patch
            if patch[0] and not patch[2]:  # placeholders the kernels did not overwrite (not a CPU device)
                finish_patch(prep.buffers, patch, prev_token_ids, inputs.input_ids)
        if self.prompt_embeds is not None or self.mrope is not None or self.mm is not None:
            self._fill_model_inputs(inputs)
        if b.drafts_written:  # None when no kept row verifies drafts (a verifying row is never discarded)
            inputs.spec_decode_metadata = spec_decode_metadata(self.kernels, b, self._preparer.buffers,
                                                               inputs.num_reqs)
        if build_metadata or self.validate:
            self.build_common_attn_metadata(inputs)
        if self.validate:
            self.check(inputs)
        return inputs

    def _fill_model_inputs(self, inputs: StepInputs) -> None:
        """The inputs only some models take: prompt embeddings, M-RoPE positions, the
        multimodal features' token slices."""
        idx, qsl = self.input_batch.req_id_to_index, inputs.query_start_loc_cpu.numpy()
        if self.prompt_embeds is not None:
            filled = self.prompt_embeds.fill(idx, inputs.num_reqs, inputs.num_padded_tokens, qsl,
                                             inputs.num_computed_tokens, inputs.num_scheduled_tokens)
            if filled is not None:  # the step has embedding rows
                inputs.inputs_embeds, inputs.is_embed = filled
        if self.mrope is not None:
            inputs.mrope_positions = self.mrope.fill(idx, inputs.num_reqs, inputs.num_padded_tokens,
                                                     inputs.positions_cpu.numpy(), qsl, inputs.num_computed_tokens,
                                                     inputs.num_scheduled_tokens)
        if self.mm is not None and self.mm.features:
            inputs.mm_slices = self.mm.slices(idx, inputs.num_reqs, qsl, inputs.num_computed_tokens,
                                              inputs.num_scheduled_tokens)

    def build_common_attn_metadata(self, inputs: StepInputs):
        """Build (and store in ``inputs``) the per-group :class:`CommonAttentionMetadata`."""
        b, R = self.input_batch, inputs.num_reqs
        drafts = torch.from_numpy(b.num_spec_tokens[:R]) if inputs.spec_decode_metadata is not None else None
        return build_common_attn_metadata(inputs, b.num_computed_tokens_cpu_view(R), drafts)

    def check(self, inputs: StepInputs) -> None:
        """Run ``attnplug.core.validate`` on every group's metadata of ``inputs``.

        Raises:
            MetadataInvariantError: the first broken invariant.
        """
        view = self.batch_view()
        for g, cm in enumerate(inputs.common_attn_metadata):
            state = not self.layout.groups[g].writes_slots
            validate(cm, block_size=None if state else self.kernel_block_sizes[g],
                     num_scheduled_tokens=inputs.num_scheduled_tokens, num_tokens=inputs.num_tokens,
                     discard=inputs.discard, batch=view, sliding_window=self.sliding_windows[g],
                     manager_block_size=self.block_sizes[g], state_group=state,
                     full_attention=self.layout.group_kinds[g] in PAGED_FULL_KINDS)

    def append_output_tokens(self, req_ids_or_rows, token_ids) -> None:
        """Append sampled tokens to requests of this step (stage 8, ``runner/step/append.py``).

        Args:
            req_ids_or_rows: request ids (``str``, or a subclass such as ``numpy.str_``), or
                batch rows (a list of ints or a 1-D integer array), of this step; distinct.
            token_ids: one token per request (``[n]`` ints), or per request a list of tokens.

        Raises:
            MetadataError: an id not in the batch, a repeated request, a row whose logits are
                discarded this step (partial prefill, or tokens already appended), a bad
                token id, or more tokens than ``max_model_len`` (nothing changes).
        """
        append_output_tokens(self.input_batch, self.max_model_len, req_ids_or_rows, token_ids)

    def append_verified_tokens(self, rows, token_ids) -> None:
        """Stage 8 of a step with drafts: per row, its accepted drafts then the corrected or
        bonus token (``runner/step/spec_apply.py``; rows without drafts take one token).

        Raises:
            MetadataError: a bad, repeated or discarded row, too many or no tokens, a bad
                token id (nothing changes).
        """
        append_verified_tokens(self.input_batch, self.max_model_len, rows, token_ids)

    def append_placeholders(self, rows) -> Placeholders:
        """Asynchronous scheduling: this step sampled ``rows`` (batch rows, in the order of
        its sampled tensor: a list of ints or a 1-D integer array) but the tokens stay on the
        device; append a placeholder to each (stage 8 without the values,
        ``runner/step/placeholders.py``). The next
        ``prepare_inputs(prev_token_ids=...)`` reads them from the device; pass the values to
        :meth:`fill_output_tokens` once they are on the host.

        Raises:
            MetadataError: rows that are not a list of ints or a 1-D integer array (a 2-D
                array is refused, not flattened), a bad, repeated or discarded row, or a full
                request.
        """
        return append_placeholders(self.input_batch, self.max_model_len, rows)

    def fill_output_tokens(self, placeholders: Placeholders, token_ids) -> int:
        """Write the real tokens over ``placeholders`` (one per entry, in order), wherever
        the requests are now; finished ones are skipped. Returns how many were written.

        Raises:
            MetadataError: a count mismatch, a bad token id, or a placeholder filled twice.
        """
        return fill_output_tokens(self.input_batch, self.requests, placeholders, token_ids)

    # --- views for checks and tests (runner/step/debug.py) ------------------------------
    def batch_view(self) -> BatchView:
        """The columnar view for ``attnplug.core.validate`` (rows and object view). Debug use."""
        return batch_view(self.input_batch, self.requests)

    def snapshot(self) -> dict:
        """A deep copy of every piece of state (both views), for before/after comparisons
        in tests (compare with :func:`snapshot_diff`). Not for the hot path. With prompt
        embeddings enabled, ``snap["prompt_embeds"]`` holds the kept ones (float32 copies);
        with images, ``snap["mm_features"]`` each request's image hashes and spans, and with
        M-RoPE ``snap["mrope"]`` each request's positions and delta."""
        snap = snapshot(self.input_batch, self.requests)
        if self.prompt_embeds is not None:
            snap["prompt_embeds"] = {rid: e.float().cpu().numpy() for rid, e in self.prompt_embeds.embeds.items()}
        if self.mm is not None:
            snap["mm_features"] = {rid: [(f.mm_hash, f.mm_position.offset, f.mm_position.grid_thw) for f in feats]
                                   for rid, feats in self.mm.features.items()}
        if self.mrope is not None:
            snap["mrope"] = {rid: (pos.copy(), delta) for rid, (pos, delta) in self.mrope.prompts.items()}
        return snap
