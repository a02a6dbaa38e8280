"""``UpdatePlan``: what stage 1 (``UpdateChecker.plan``) hands stage 2 (``apply_update``),
validated and converted — the only hand-off between them, on both kernel paths.

The compiled scans (``runner/step/kernels.py``) write into :class:`ScanBuffers`, which the
checker owns; the plan's arrays are then views of those buffers, exactly the arrays the
numpy checks would have built. Every array is valid until the next ``UpdateChecker.plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from attnplug.runner.step.request_state import CachedRequestState

if TYPE_CHECKING:
    from attnplug.runner.step.check.snapshot import NewReq


@dataclass
class BlockAppends:
    """Validated block appends of ``m`` cached requests, all groups at once."""

    sel: np.ndarray
    """``[m]`` ``int64`` indices into ``scheduled_cached_reqs``."""
    starts: np.ndarray
    """``[num_groups, m]`` ``int64`` blocks each row holds before the append."""
    lens: np.ndarray | int
    """``[num_groups, m]`` ``int64`` blocks appended (the int ``1`` when ``one_each``)."""
    after: np.ndarray
    """``[num_groups, m]`` ``int64`` blocks each row holds after the append."""
    flat: np.ndarray
    """``[sum(lens)]`` integer appended ids, group-major, then in ``sel`` order."""
    one_each: bool
    """Every row gets exactly one block in every group."""


@dataclass
class SpecTokens:
    """The checked drafts of one step (``UpdatePlan.spec_tokens``)."""

    req_ids: list[str]
    """The verifying requests."""
    lens: np.ndarray
    """``[n]`` ``int64`` drafts of each (``>= 1``)."""
    flat: np.ndarray
    """``[sum(lens)]`` ``int32`` the drafts, request after request."""
    rows: np.ndarray | None = None
    """``[n]`` ``int64`` their batch rows when stage 1 knew them (the compiled scan), valid
    while stage 2 moves no row; ``None``: look the ids up."""


@dataclass
class ScanBuffers:
    """The plan buffers a compiled cached scan writes (owned by the ``UpdateChecker``;
    ``M`` = ``max_num_reqs``, ``G`` = cache groups, ``A`` = appended ids one group may take,
    ``S`` = drafts one step may carry). Entry ``i`` of ``rows`` / ``ncts`` / ``counts``
    belongs to the ``i``-th cached request of the step; the ``app_*`` and ``spec_*`` arrays
    are compact (the appending / verifying requests only)."""

    rows: np.ndarray
    """``[M]`` ``int64`` batch rows."""
    ncts: np.ndarray
    """``[M]`` ``int64`` ``num_computed_tokens``."""
    counts: np.ndarray
    """``[M]`` ``int64`` ``num_scheduled_tokens``."""
    app_sel: np.ndarray
    """``[M]`` ``int64`` the cached indices that append blocks, in order."""
    app_start: np.ndarray
    """``[G, M]`` ``int64`` per appending request, blocks held before the append."""
    app_len: np.ndarray
    """``[G, M]`` ``int64`` per appending request, blocks appended."""
    app_ids: np.ndarray
    """``[G, A]`` ``int32`` per group, the appended ids in ``app_sel`` order."""
    app_total: np.ndarray
    """``[G]`` ``int64`` appended ids per group."""
    app_after: np.ndarray
    """``[G, M]`` ``int64`` per appending request, blocks held after the append."""
    app_flat: np.ndarray
    """``[G * A]`` ``int32`` every group's appended ids back to back (``BlockAppends.flat``)."""
    spec_sel: np.ndarray
    """``[M]`` ``int64`` per verifying request (in cached order), its cached index."""
    spec_rows: np.ndarray
    """``[M]`` ``int64`` per verifying request, its batch row."""
    spec_lens: np.ndarray
    """``[M]`` ``int64`` per verifying request, its draft count (``>= 1``)."""
    spec_ids: np.ndarray
    """``[S]`` ``int32`` the drafts, request after request in cached order."""
    views: dict = field(default_factory=dict)
    """Views of these buffers already made, by shape key (``check/fast.py``: a plan's
    prefixes and :class:`BlockAppends`); they stay valid because the buffers persist."""

    @classmethod
    def allocate(cls, max_num_reqs: int, num_groups: int, append_capacity: int = 1 << 12,
                 spec_capacity: int = 1 << 14) -> "ScanBuffers":
        M, G, A = max_num_reqs, num_groups, append_capacity
        i64 = lambda *shape: np.zeros(shape, np.int64)  # noqa: E731
        return cls(i64(M), i64(M), i64(M), i64(M), i64(G, M), i64(G, M), np.zeros((G, A), np.int32), i64(G),
                   i64(G, M), np.zeros(G * A, np.int32), i64(M), i64(M), i64(M), np.zeros(spec_capacity, np.int32))


@dataclass
class UpdatePlan:
    """Everything :func:`apply_update` needs, already validated and converted.

    ``C`` = cached requests of the step (``scheduled_cached_reqs``).
    """

    finished: list[str]
    """Finished ids, deduplicated, in order (their states are dropped)."""
    unscheduled: list[str]
    """Ids in the batch that this step does not schedule (their rows go; state kept)."""
    new_states: list[CachedRequestState]
    """Detached states of the new requests the numpy check converted (empty when
    ``staged_new`` holds them)."""
    new_counts: list[int]
    """``num_scheduled_tokens`` of every new request, in ``scheduled_new_reqs`` order."""
    readd_ids: list[str]
    """Cached requests that are resident but not in the batch (they get rows again)."""
    readd: list[int]
    """Their indices in ``scheduled_cached_reqs``."""
    rows_c: np.ndarray
    """``[C]`` ``int64`` batch rows of the cached requests (-1 for ``readd`` ones)."""
    counts_c: np.ndarray
    """``[C]`` ``int64`` their ``num_scheduled_tokens``."""
    ncts_c: np.ndarray
    """``[C]`` ``int64`` their ``num_computed_tokens``."""
    token_deltas: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """``(cached index, [n] int32 tokens)`` for each cached request that carries tokens."""
    resumed: list[tuple[int, tuple[np.ndarray, ...]]] = field(default_factory=list)
    """``(cached index, per group [n_g] int32 ids)``: replacement lists of resumed requests."""
    appends: BlockAppends | None = None
    """Blocks appended to non-resumed cached requests; ``None`` when there are none."""
    staged_new: "list[NewReq] | None" = None
    """New requests the compiled new-request scan checked and staged (the kernels write
    their rows: ``InputBatch.add_requests(..., staged=...)``); ``None`` when
    ``new_states`` holds them."""
    spec_tokens: SpecTokens | None = None
    """Speculative decoding: the step's checked drafts, or ``None``; stage 2 writes them
    after the requests' tokens (``spec_apply.py``)."""
    prompt_embeds: dict = field(default_factory=dict)
    """``{req_id: [num_prompt_tokens, hidden_size] tensor}``: the checked embeddings of the
    new requests that carry them (the caller's tensors; stage 2 copies them,
    ``runner/step/prompt_embeds.py``)."""
    mm_placeholders: dict = field(default_factory=dict)
    """``{req_id: (placeholders, num_prompt_tokens)}``: the checked image spans of the new
    requests that carry them (stage 2 computes their M-RoPE positions, ``runner/step/mrope.py``)."""
    mm_features: dict = field(default_factory=dict)
    """``{req_id: (features, num_prompt_tokens)}``: the checked images of the new requests that
    carry them (``runner/step/multimodal.py``); their spans are in ``mm_placeholders`` too."""
