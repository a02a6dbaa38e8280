"""``UpdatePlan``: what stage 1 (``UpdateChecker.plan``) hands stage 2 (``apply_update``) (validated, converted)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attnplug.runner.step.request_state import CachedRequestState


@dataclass
class BlockAppends:
    """Validated block appends of ``m`` cached requests, all groups at once."""

    sel: np.ndarray
    """``[m]`` indices into ``scheduled_cached_reqs``."""
    starts: np.ndarray
    """``[num_groups, m]`` blocks each row holds before the append."""
    lens: np.ndarray | int
    """``[num_groups, m]`` blocks appended (``1`` when ``one_each``)."""
    after: np.ndarray
    """``[num_groups, m]`` blocks each row holds after the append."""
    flat: np.ndarray
    """The appended ids, group-major, then in ``sel`` order."""
    one_each: bool
    """Every row gets exactly one block in every group."""


@dataclass
class UpdatePlan:
    """Everything :func:`apply_update` needs, already validated and converted."""

    finished: list[str]
    unscheduled: list[str]
    new_states: list[CachedRequestState]
    new_counts: list[int]
    readd_ids: list[str]
    """Cached requests that are resident but not in the batch (they get rows again)."""
    readd: list[int]
    """Their indices in ``scheduled_cached_reqs``."""
    rows_c: np.ndarray
    """``[num_cached]`` int64 batch rows of the cached requests (-1 for ``readd`` ones)."""
    counts_c: np.ndarray
    ncts_c: np.ndarray
    token_deltas: list[tuple[int, np.ndarray]] = field(default_factory=list)
    resumed: list[tuple[int, tuple[np.ndarray, ...]]] = field(default_factory=list)
    appends: BlockAppends | None = None
    """Blocks appended to non-resumed cached requests; ``None`` when there are none."""
    new_scanned: list | None = None
    """The fresh requests (``NewRequestData``) staged by the compiled ``NewScan``; then
    ``new_states`` is empty and ``InputBatch.admit_scanned`` admits them."""
    spec_tokens: object = None
    """Speculative decoding: the step's checked drafts (``check_spec.SpecTokens``), or
    ``None``; stage 2 writes them after the requests' tokens (``spec_apply.py``)."""
    native: bool = False
    """Planned by the compiled scan (``runner/step/check_fast.py``): the cached requests' merge
    is ``Scans.cached.apply()`` (``runner/step/fast/bind.py``), and ``rows_c`` … ``appends`` are unused."""
