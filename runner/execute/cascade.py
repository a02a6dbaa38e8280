"""Cascade attention per step: ``common_prefix_len`` per cache group and whether to use it.

With prefix caching several requests of a step may read the same physical blocks first
(a shared system prompt). Cascade attention attends every query to that shared prefix in
one pass and each request to its own suffix in another, then merges the two by
log-sum-exp (``backends/common/merge.py``), so the prefix's K/V is read once per step
instead of once per request.

Per group ``g`` and step (vLLM's ``_compute_cascade_attn_prefix_len`` /
``use_cascade_attention``; semantics, not code):

* ``common_prefix_len``: the longest run of leading block-table columns whose manager
  block id is the same real (non-null) block in every row of the step, in tokens,
  clamped to the smallest ``num_computed_tokens`` (every query must see the whole prefix,
  and no query's own K/V may sit in it) and rounded down to the group's kernel block size;
  0 for a sliding-window or Mamba group (a query need not see the whole prefix there).
* the decision: cascade runs iff ``common_prefix_len >= min_prefix_len`` (tokens),
  ``num_reqs >= min_num_reqs`` and the group's builder declares ``supports_cascade``; the
  step is not padded for CUDA graphs (a captured graph has no cascade pass). The builder
  then gets ``common_prefix_len``, else 0. Defaults are vLLM's (256 tokens, 8 requests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import MetadataError


@dataclass(frozen=True)
class CascadeConfig:
    """When the runner uses cascade attention.

    Attributes:
        enabled: ``False`` never uses it (every builder gets ``common_prefix_len = 0``).
        min_prefix_len: tokens of shared prefix needed, ``>= 1``.
        min_num_reqs: requests in the step needed, ``>= 2``.

    Raises:
        MetadataError: a threshold out of range.
    """

    enabled: bool = True
    min_prefix_len: int = 256
    min_num_reqs: int = 8

    def __post_init__(self):
        if self.min_prefix_len < 1 or self.min_num_reqs < 2:
            raise MetadataError(f"CascadeConfig: need min_prefix_len >= 1 ({self.min_prefix_len}) and "
                                f"min_num_reqs >= 2 ({self.min_num_reqs})")


@dataclass(frozen=True)
class CascadeDecision:
    """One group's cascade decision of one step.

    Attributes:
        common_prefix_len: shared prefix in tokens (see the module docstring).
        use_cascade: the builder got ``common_prefix_len`` (else 0).
        reason: why not, when ``use_cascade`` is False ("" when it is True).
    """

    common_prefix_len: int
    use_cascade: bool
    reason: str


def common_prefix_len(block_table: np.ndarray, num_blocks_per_row: np.ndarray, num_computed_tokens: np.ndarray,
                      block_size: int, kernel_block_size: int) -> int:
    """Tokens whose blocks are the same physical blocks in every row.

    Args:
        block_table: ``[num_reqs, max_blocks]`` int manager block ids (rows of the step).
        num_blocks_per_row: ``[num_reqs]`` valid blocks per row.
        num_computed_tokens: ``[num_reqs]`` tokens with K/V before the step.
        block_size: the group's manager block size (tokens).
        kernel_block_size: the kernel block size (divides ``block_size``).

    Returns:
        A multiple of ``kernel_block_size``, ``<= min(num_computed_tokens)``; 0 with no rows.
    """
    R = block_table.shape[0]
    if R == 0:
        return 0
    width = int(num_blocks_per_row.min())
    if width == 0 or block_table[0, 0] == NULL_BLOCK_ID or (block_table[:, 0] != block_table[0, 0]).any():
        return 0  # the common case without prefix caching: rows differ from the first block on
    head = block_table[:, :width]
    same = (head == head[:1]).all(axis=0) & (head[0] != NULL_BLOCK_ID)
    k = width if same.all() else int(np.argmin(same))
    tokens = min(k * block_size, int(num_computed_tokens.min()))
    return tokens // kernel_block_size * kernel_block_size


def decide(cfg: CascadeConfig, prefix_lens: Sequence[int], supports: Sequence[bool],
           reasons_unsupported: Sequence[str], num_reqs: int, padded: bool) -> list[CascadeDecision]:
    """Per group, whether the step runs cascade attention (see the module docstring)."""
    out = []
    for p, ok, why in zip(prefix_lens, supports, reasons_unsupported):
        if not cfg.enabled:
            reason = "cascade attention is off"
        elif p == 0:
            reason = "no shared prefix"
        elif not ok:
            reason = why or "the backend does not declare supports_cascade"
        elif p < cfg.min_prefix_len:
            reason = f"shared prefix {p} < min_prefix_len {cfg.min_prefix_len}"
        elif num_reqs < cfg.min_num_reqs:
            reason = f"{num_reqs} requests < min_num_reqs {cfg.min_num_reqs}"
        elif padded:
            reason = "the step is padded for a CUDA graph"
        else:
            reason = ""
        out.append(CascadeDecision(p, reason == "", reason))
    return out


def step_prefix_lens(compiler, common: Sequence, sliding_or_state: Sequence[bool]) -> list[int]:
    """``common_prefix_len`` of every group of the step ``compiler`` just prepared.

    Args:
        compiler: the ``StepCompiler`` (its ``input_batch`` block tables, rows ``0 .. R-1``).
        common: per group, the step's ``CommonAttentionMetadata``.
        sliding_or_state: per group, True for a sliding-window or Mamba group (always 0).
    """
    batch = compiler.input_batch
    R = batch.num_reqs
    out = []
    for g, (cm, skip) in enumerate(zip(common, sliding_or_state)):
        if skip or R < 2:
            out.append(0)
            continue
        bt = batch.block_table[g]
        out.append(common_prefix_len(bt.block_table_np[:R], bt.num_blocks_per_row[:R],
                                     cm.num_computed_tokens_cpu[:R].numpy(), compiler.block_sizes[g],
                                     compiler.kernel_block_sizes[g]))
    return out


class CascadePlanner:
    """The runner's per-step cascade decisions and their counters.

    Args:
        cfg: the thresholds.
        builders: per group, its builder (``supports_cascade``, ``cascade_unsupported_reason``).
        skip_groups: per group, True for a sliding-window or Mamba group.

    Attributes:
        decisions: the latest step's :class:`CascadeDecision` per group.
        num_cascade_steps: steps in which some group ran cascade attention.
        num_steps: steps planned.
        reason_counts: ``{reason: groups x steps}`` of the decisions against cascade so far.
    """

    def __init__(self, cfg: CascadeConfig, builders: Sequence, skip_groups: Sequence[bool]):
        self.cfg = cfg
        self.supports = [bool(getattr(b, "supports_cascade", False)) for b in builders]
        self.reasons = [str(getattr(b, "cascade_unsupported_reason", "")) for b in builders]
        self.skip = list(skip_groups)
        self.decisions: list[CascadeDecision] = []
        self.num_cascade_steps = 0
        self.num_steps = 0
        self.reason_counts: dict[str, int] = {}

    def plan(self, compiler, common: Sequence, padded: bool) -> list[int]:
        """Per group, the ``common_prefix_len`` to pass to its builder (0: no cascade)."""
        self.num_steps += 1
        if not self.cfg.enabled:
            self.decisions = [CascadeDecision(0, False, "cascade attention is off")] * len(self.skip)
            return [0] * len(self.skip)
        lens = step_prefix_lens(compiler, common, self.skip)
        self.decisions = decide(self.cfg, lens, self.supports, self.reasons, compiler.input_batch.num_reqs, padded)
        self.num_cascade_steps += any(d.use_cascade for d in self.decisions)
        for d in self.decisions:
            if d.reason:
                self.reason_counts[d.reason] = self.reason_counts.get(d.reason, 0) + 1
        return [d.common_prefix_len if d.use_cascade else 0 for d in self.decisions]
