"""Stage 1 of a step: check a ``SchedulerOutput`` in full against the state; change nothing.

:class:`UpdateChecker` reads the output once, field family by field family, and returns
an :class:`~attnplug.runner.step.plan.UpdatePlan` that stage 2 (``runner/step/apply.py``)
applies; the first problem raises :class:`InvalidSchedulerOutput` naming the request and
field at fault. The checks, in the order they run:

1. containers, read once (``check/snapshot.py``), and ids: ``check_finished_and_new``;
2. the kernels' scans (``check/fast.py``) for a regular output (the compiled scan reads
   packed drafts and appends, ``PackedCachedDeltas``, as they are), else the vectorized
   checks, on vLLM's form (packed arrays converted first, ``check/packed.py``):
3. cached rows, ``num_scheduled_tokens``, computed tokens and token deltas
   (``check/cached.py``);
4. block deltas: replacements, appends, windows, capacity (``check/blocks.py``,
   ``check/windows.py``);
5. new requests: prompts, blocks, sampling (``check/new.py``), then their prompt
   embeddings (``prompt_embeds.py``) and image spans (``mrope.py``);
6. draft tokens of speculative decoding (``check/spec.py``, before 3 reads ``seq_lens``;
   the compiled cached scan checks the drafts of a regular step itself).

Per-request Python work is limited to what the data structure forces (one dict lookup
per scheduled request, a loop over the few requests that carry token or block payloads);
there is no per-token Python loop.
"""

from __future__ import annotations

from typing import Sequence

from attnplug.cache_groups.kinds import GroupKind
from attnplug.core.errors import InvalidSchedulerOutput

from attnplug.runner.step.check.blocks import block_deltas
from attnplug.runner.step.check.cached import cached_rows, computed_and_token_deltas, scheduled_counts
from attnplug.runner.step.check.fast import plan_update_scanned
from attnplug.runner.step.check.packed import renamed, unpack_into
from attnplug.runner.step.check.types import err, request_id, show
from attnplug.runner.step.check.new import plan_new_requests
from attnplug.runner.step.check.snapshot import Deltas, NewReq
from attnplug.runner.step.check.spec import check_spec_tokens, check_state_slots
from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.int_packer import IntPacker
from attnplug.runner.step.step_kernels import StepKernels
from attnplug.runner.step.plan import ScanBuffers, UpdatePlan
from attnplug.runner.step.mrope import check_placeholders
from attnplug.runner.step.multimodal import MultiModalConfig, check_mm_features
from attnplug.runner.step.prompt_embeds import PromptEmbedsConfig, check_prompt_embeds
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import SchedulerOutput


def check_finished_and_new(reqs: dict[str, CachedRequestState], d: Deltas
                           ) -> tuple[list[str], set[str], set[str]]:
    """The checks both planning paths run first (after :class:`Deltas` read the output):
    finished ids, new ids.

    Returns:
        ``(finished, fin_set, new_ids)``: finished ids deduplicated in order, as a set,
        and the new requests' ids.
    """
    finished = d.finished_req_ids
    fin_set = set(finished)
    for rid in finished:
        if rid not in reqs:
            request_id(rid, "finished_req_ids")  # (a str subclass is looked up by its value)
            err(rid, "finished_req_ids", "unknown request: the runner never held it or already dropped it")
    new_ids: set[str] = set()
    for nr in d.scheduled_new_reqs:
        rid = nr.req_id
        if rid in reqs and rid not in fin_set:
            err(rid, "scheduled_new_reqs", "request is already resident: send it in scheduled_cached_reqs "
                "(or finish it in the same step to restart it)")
        if rid in new_ids:
            err(rid, "scheduled_new_reqs", "request listed twice")
        new_ids.add(rid)
    return finished, fin_set, new_ids


class UpdateChecker:
    """Stage 1 over one batch: its packers, its plan buffers and the step's kernels.

    Args:
        layout: the step layout.
        batch: the batch the output is checked against.
        requests: ``{req_id: CachedRequestState}`` of every resident request.
        kernels: the step's kernels (``runner/step/kernels.py``): the packing loop and the
            scans that plan a regular output in one pass.

    The arrays of a plan (prompts, block ids, token deltas, the scanned rows and counts)
    are views into the packers' and :attr:`buffers`' memory: valid until the next :meth:`plan`.
    """

    def __init__(self, layout: StepLayout, batch: InputBatch, requests: dict[str, CachedRequestState],
                 kernels: StepKernels):
        self.layout, self.batch, self.requests, self.kernels = layout, batch, requests, kernels
        self.buffers = ScanBuffers.allocate(layout.max_num_reqs, layout.num_groups)
        """The plan buffers the kernels' cached scan writes (``plan.ScanBuffers``)."""
        self.prompt_packer = IntPacker(kernels)
        self.block_packer = IntPacker(kernels, 1 << 12)
        self.delta_packer = IntPacker(kernels, 1 << 10)
        self.last_scanned = False
        """Whether the last :meth:`plan` came from the kernels' scans (for tests and benches)."""
        self.prompt_embeds_config: PromptEmbedsConfig | None = None
        """Width and dtype of the prompt embeddings new requests may carry (``None``: none)."""
        self.uses_mrope = False
        """Whether new requests may carry ``mm_placeholders`` (M-RoPE positions)."""
        self.mm_config: MultiModalConfig | None = None
        """What images new requests may carry (``mm_features``; ``None``: none)."""

    def plan_new(self, new_reqs: Sequence[NewReq], new_counts: Sequence[int]) -> list[CachedRequestState]:
        """Check the new requests (``check.new.plan_new_requests`` with this checker's packers)."""
        return plan_new_requests(self.layout, self.prompt_packer, self.block_packer, new_reqs, new_counts)

    def plan(self, so: SchedulerOutput) -> UpdatePlan:
        """Check ``so`` against the state; change nothing.

        Takes the kernels' scans when the output is regular; the vectorized checks
        otherwise (same plan, same errors).

        Raises:
            InvalidSchedulerOutput: the first problem found, with its request id and field.
        """
        d = Deltas(so)  # every field read once, here; the checks below read only this
        finished, fin_set, new_ids = check_finished_and_new(self.requests, d)
        plan = plan_update_scanned(self.layout, self.batch, self.kernels, self.buffers, self.plan_new, d,
                                   finished, fin_set)
        self.last_scanned = plan is not None
        if plan is not None:
            if plan.spec_tokens is not None:
                self._check_scanned_state_slots(d, plan)
            self._check_extras(plan, d.scheduled_new_reqs)
            return plan
        if d.packed is None:
            return self._plan_checked(d, finished, fin_set, new_ids)
        packed_appends = unpack_into(d, self.layout.num_groups)  # the packed form as vLLM's
        try:
            return self._plan_checked(d, finished, fin_set, new_ids)
        except InvalidSchedulerOutput as e:
            raise renamed(e, packed_appends) from None

    def _check_scanned_state_slots(self, d: Deltas, plan: UpdatePlan) -> None:
        """The state slots of a scanned plan's verifying requests (``check_state_slots``),
        refused under the packed field's name when the drafts came packed, as on the
        vectorized path."""
        if d.packed is None:
            check_state_slots(self.layout, self.batch, self.requests, d, plan.spec_tokens)
            return
        packed_appends = set()
        if GroupKind.MAMBA in self.layout.group_kinds:  # (check_state_slots counts new_block_ids)
            packed_appends = unpack_into(d, self.layout.num_groups)
        try:
            check_state_slots(self.layout, self.batch, self.requests, d, plan.spec_tokens)
        except InvalidSchedulerOutput as e:
            raise renamed(e, packed_appends) from None

    def _plan_checked(self, d: Deltas, finished: list[str], fin_set: set[str], new_ids: set[str]) -> UpdatePlan:
        """The vectorized checks of ``d`` (in vLLM's form): the plan, or the first problem."""
        lay, batch, reqs = self.layout, self.batch, self.requests
        cached = d.scheduled_cached_reqs
        C = cached.req_ids
        rows = cached_rows(lay, batch, reqs, C, finished, fin_set)
        counts_c, new_counts = scheduled_counts(lay, d, C, new_ids)
        drafts_c, spec = check_spec_tokens(lay, batch, reqs, d, rows.rows_c, counts_c, new_ids)
        ncts_c, seq_c, token_deltas = computed_and_token_deltas(lay, batch, reqs, cached, rows, counts_c,
                                                                self.delta_packer, drafts_c)
        resumed, appends = block_deltas(lay, batch, reqs, cached, rows.rows_c, rows.readd, ncts_c, seq_c)
        check_state_slots(lay, batch, reqs, d, spec)
        new_states = self.plan_new(d.scheduled_new_reqs, new_counts)
        unscheduled: list[str] = []
        if batch.num_reqs - rows.fin_in_batch > rows.present.shape[0]:
            mask = rows.sched_mask
            unscheduled = [rid for rid, r in batch.req_id_to_index.items() if not mask[r] and rid not in fin_set]
        plan = UpdatePlan(finished, unscheduled, new_states, new_counts, rows.readd_ids, rows.readd, rows.rows_c,
                          counts_c, ncts_c, token_deltas, resumed, appends, spec_tokens=spec)
        self._check_extras(plan, d.scheduled_new_reqs)
        return plan

    def _check_extras(self, plan: UpdatePlan, new_reqs) -> None:
        """The new requests' prompt embeddings, M-RoPE spans and images into ``plan``. The
        three checks look only at requests that carry their field (in order), so they get
        only the requests that carry one of them (none, most steps: the plan's empty
        defaults stay)."""
        extras = [nr for nr in new_reqs if nr.prompt_embeds is not None or nr.mm_placeholders is not None
                  or nr.mm_features is not None]
        if extras:
            plan.prompt_embeds = check_prompt_embeds(self.prompt_embeds_config, extras)
            plan.mm_placeholders = check_placeholders(self.uses_mrope, extras)
            self._check_images(plan, extras)

    def _check_images(self, plan: UpdatePlan, new_reqs) -> None:
        """The new requests' ``mm_features`` into ``plan`` (``runner/step/multimodal.py``);
        with M-RoPE their spans join ``plan.mm_placeholders``."""
        plan.mm_features = check_mm_features(self.mm_config, new_reqs)
        if self.uses_mrope:
            for rid, (feats, L) in plan.mm_features.items():
                plan.mm_placeholders[rid] = (tuple(f.mm_position for f in feats), L)
