"""``GroupLayout`` per cache group and ``StepLimits``: what the step compiler is sized by.

One :class:`GroupLayout` describes one KV-cache group as the step compiler sees it (its
kind, manager and kernel block sizes, pool size, window); :class:`StepLimits` holds the
batch limits; :class:`StepLayout` bundles both with the per-group lists and columns the
hot path reads (derived once, at construction). Every stage of the step (check, apply,
prepare) takes a ``StepLayout``; none of them takes the ``StepCompiler``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from attnplug.cache_groups.grouping import KVCacheConfig
from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.specs import cdiv
from attnplug.core.errors import KVCacheSpecError

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class StepLimits:
    """Batch limits (vLLM's scheduler-config names).

    Attributes:
        max_num_reqs: most requests in one step (batch rows).
        max_model_len: most tokens one request may hold (prompt + outputs).
        max_num_batched_tokens: most tokens in one step (the token budget).
    """

    max_num_reqs: int
    max_model_len: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class GroupLayout:
    """One cache group as the step compiler sees it.

    Attributes:
        kind: the group's :class:`GroupKind`.
        block_size: manager block size (tokens per block id the scheduler sends).
        kernel_block_size: the kernel's block size; divides ``block_size`` (one manager
            block ``b`` is kernel blocks ``b*k .. b*k+k-1``, ``k = block_size //
            kernel_block_size``).
        num_blocks: pool size; valid ids are ``[1, num_blocks)`` (0 is the null block).
            A Mamba group's ids are state slots.
        sliding_window: ``W`` tokens for a sliding-window group whose skipped blocks the
            compiler nulls each step (``runner/step/apply_windows.py``), else ``None``.
    """

    kind: GroupKind
    block_size: int
    kernel_block_size: int
    num_blocks: int
    sliding_window: int | None = None

    @property
    def null_block_allowed(self) -> bool:
        """The null block may stand in a request's initial or replacement block list (a
        sliding-window group's skipped prefix)."""
        return self.kind is GroupKind.SLIDING_WINDOW

    @property
    def writes_slots(self) -> bool:
        """The group's tokens get slots (paged K/V); a Mamba group's do not."""
        return self.kind is not GroupKind.MAMBA

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_block_size

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        """``cdiv(max_model_len, block_size)``: block ids one request may hold."""
        return cdiv(max_model_len, self.block_size)

    def tokens_per_block(self, max_model_len: int) -> int:
        """Tokens one block id covers, for the "block table too short" check: a Mamba
        group's single state slot covers any length (``max_model_len``)."""
        return max_model_len if self.kind is GroupKind.MAMBA else self.block_size


class StepLayout:
    """The groups and limits, with the per-group lists and columns the hot path reads.

    Args:
        groups: one :class:`GroupLayout` per cache group, in group order.
        limits: the batch limits.

    Attributes (derived, read-only by convention):
        num_groups, block_sizes, kernel_block_sizes, group_kinds, sliding_windows,
        null_block_allowed, num_blocks_per_group, max_num_blocks_per_req: per group,
            lists in group order.
        num_blocks: the smallest pool (ids below it are valid in every group).
        has_sliding_windows: some group has a window the compiler applies.
        max_blocks_col, capacity_col: ``[num_groups, 1]`` ``int64`` columns of
            ``max_num_blocks_per_req`` and tokens per block (for broadcasting checks).
        max_num_reqs, max_model_len, max_num_batched_tokens: from ``limits``.
    """

    def __init__(self, groups: Sequence[GroupLayout], limits: StepLimits):
        self.groups = tuple(groups)
        self.limits = limits
        self.max_num_reqs = limits.max_num_reqs
        self.max_model_len = limits.max_model_len
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.num_groups = len(self.groups)
        self.block_sizes = [g.block_size for g in self.groups]
        self.kernel_block_sizes = [g.kernel_block_size for g in self.groups]
        self.group_kinds = [g.kind for g in self.groups]
        self.sliding_windows = [g.sliding_window for g in self.groups]
        self.null_block_allowed = [g.null_block_allowed for g in self.groups]
        self.has_sliding_windows = any(w is not None for w in self.sliding_windows)
        self.num_blocks_per_group = [g.num_blocks for g in self.groups]
        self.num_blocks = min(self.num_blocks_per_group)
        self.max_num_blocks_per_req = [g.max_num_blocks_per_req(limits.max_model_len) for g in self.groups]
        self.max_blocks_col = np.asarray(self.max_num_blocks_per_req, dtype=np.int64)[:, None]
        self.capacity_col = np.asarray([g.tokens_per_block(limits.max_model_len) for g in self.groups],
                                       dtype=np.int64)[:, None]

    @classmethod
    def from_args(cls, block_sizes: Sequence[int] | KVCacheConfig, limits: StepLimits, *,
                  kernel_block_sizes: Sequence[int] | None = None, num_blocks: int | Sequence[int] | None = None,
                  group_kinds: Sequence[str] | None = None,
                  sliding_windows: Sequence[int | None] | None = None) -> StepLayout:
        """The layout from ``StepCompiler``'s arguments (see its docstring).

        Defaults: with a :class:`KVCacheConfig`, block sizes, pool sizes, kinds and windows
        come from its groups' specs; kernel block sizes equal the manager's; the pool of
        each group is every id whose kernel expansion fits ``int32``.

        Raises:
            KVCacheSpecError: a list of the wrong length, an unknown kind, a window on a
                group that is not ``"sliding_window"`` (or not a positive int), a pool
                under 2 blocks.
        """
        if isinstance(block_sizes, KVCacheConfig):
            cfg = block_sizes
            block_sizes = cfg.block_sizes
            if num_blocks is None:
                num_blocks = [cfg.num_blocks_of(g) for g in range(len(cfg.groups))]
            if group_kinds is None:
                group_kinds = [g.kv_cache_spec.kind for g in cfg.groups]
            if sliding_windows is None:
                sliding_windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in cfg.groups]
        sizes = [int(b) for b in block_sizes]
        G = len(sizes)
        kernel = list(sizes if kernel_block_sizes is None else kernel_block_sizes)
        if len(kernel) != G:  # the values are checked by the block tables (BlockTable)
            raise KVCacheSpecError(f"kernel_block_sizes {kernel!r}: need one per cache group ({G})")
        names = list(group_kinds or [GroupKind.FULL_ATTENTION] * G)
        try:
            kinds = [GroupKind.parse(k) for k in names]
        except ValueError:
            kinds = []
        if len(kinds) != G:
            raise KVCacheSpecError(f"group_kinds {names!r}: need one of "
                                   f"{tuple(k.value for k in GroupKind)} per group")
        windows = list(sliding_windows or [None] * G)
        if len(windows) != G or any(
                w is not None and (k is not GroupKind.SLIDING_WINDOW or isinstance(w, bool)
                                   or not isinstance(w, int) or w <= 0)
                for w, k in zip(windows, kinds)):
            raise KVCacheSpecError(f"sliding_windows {windows!r}: need one entry per group, a positive "
                                   "int only for 'sliding_window' groups and None for the others")
        if num_blocks is None:
            expand = [b // k if isinstance(k, int) and k > 0 else 1 for b, k in zip(sizes, kernel)]
            num_blocks = INT32_MAX // max(expand, default=1)
        pools = [int(n) for n in num_blocks] if isinstance(num_blocks, (list, tuple)) else [int(num_blocks)] * G
        if len(pools) != G or (G and min(pools) < 2):
            raise KVCacheSpecError(f"num_blocks must be >= 2 (block 0 is the null block) per group, got {num_blocks}")
        return cls([GroupLayout(k, b, kb, n, w) for k, b, kb, n, w in zip(kinds, sizes, kernel, pools, windows)],
                   limits)
