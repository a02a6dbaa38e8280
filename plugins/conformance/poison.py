"""Which KV-cache blocks hold NaN before each step of a conformance run, and why.

No query of a step may read these blocks, masked or not: a kernel that loads one and
masks it out still computes ``0 * NaN = NaN`` (or ``NaN + -inf``), so the read shows in
the output. Per cache group and step they are:

* the null block (manager block ``NULL_BLOCK_ID`` = 0, i.e. kernel blocks ``0 .. k - 1``
  when a manager block holds ``k`` kernel blocks): never handed to a request, written
  by the runner over freed sliding-window blocks in the block table;
* spare blocks: in the pool, owned by no request of the case;
* the blocks of a request that has not been admitted yet (another request's blocks, as
  far as the running ones are concerned);
* a sliding-window request's freed blocks: whole manager blocks before
  ``max(0, num_computed_tokens - W + 1)`` (what the block pool frees and the runner
  nulls, ``docs/architecture.md``, conventions).

Everything else a request owns starts with a large *finite* poison when it is admitted
(stale contents of a reused block): a block-granular kernel may load the unwritten tail
of a request's last block, or the out-of-window head of its first visible block, and
mask it, as paged kernels do.
"""

from __future__ import annotations

import torch

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.plugins.conformance.cases import ConformanceCase

_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of the same width: compares NaN poison bit for bit."""
    return t.view(_INT_OF[t.element_size()]) if t.is_floating_point() else t


class PoisonPlan:
    """The NaN blocks of every step of one case (see the module docstring).

    Args:
        case: the case.
        blocks: per cache group, per request index, the request's manager block ids.
        num_blocks: manager blocks per pool (the null block included).
        steps: the run's schedule (``harness.schedule``): per step ``{request: tokens}``.
        kernel_block_size: tokens per kernel block (divides ``case.block_size``).
    """

    def __init__(self, case: ConformanceCase, blocks, num_blocks: int, steps: list[dict[int, int]],
                 kernel_block_size: int):
        self.case, self.blocks, self.num_blocks, self.kbs = case, blocks, num_blocks, kernel_block_size
        self.k = case.block_size // kernel_block_size
        self.first_step = {i: min(s for s, st in enumerate(steps) if i in st) for i in range(len(case.requests))}

    def kernel_blocks(self, manager_block: int) -> range:
        """The kernel block ids of one manager block."""
        return range(manager_block * self.k, (manager_block + 1) * self.k)

    def admitted_at(self, step: int) -> list[int]:
        """Request indices whose first step is ``step`` (their blocks get the finite poison)."""
        return [i for i, s in self.first_step.items() if s == step]

    def nan_blocks(self, step: int, group: int, computed: list[int]) -> dict[int, str]:
        """``{kernel block id: why it holds NaN}`` before ``step`` in ``group``.

        Args:
            step: the step index.
            group: the cache group.
            computed: per request, tokens computed before the step.
        """
        out: dict[int, str] = {}

        def add(manager: int, why: str) -> None:
            for j, kb in enumerate(self.kernel_blocks(manager)):
                where = f" (kernel block {j} of manager block {manager})" if self.k > 1 else ""
                out[kb] = f"block {kb}{where}: {why}"

        add(NULL_BLOCK_ID, "the null block (NULL_BLOCK_ID), never a request's")
        owned = {b for req in self.blocks[group] for b in req}
        for b in range(1, self.num_blocks):
            if b not in owned:
                add(b, "a spare block no request owns")
        B, W = self.case.block_size, self.case.sliding_window
        for i, req_blocks in enumerate(self.blocks[group]):
            if self.first_step[i] > step:
                for b in req_blocks:
                    add(b, f"request r{i}'s, which is not admitted before step {self.first_step[i]} "
                           "(another request's block)")
            elif W is not None:
                lo = max(0, computed[i] - W + 1)
                for j, b in enumerate(req_blocks):
                    if (j + 1) * B <= lo:
                        add(b, f"request r{i}'s block of positions {j * B}..{(j + 1) * B - 1}, freed: after "
                               f"{computed[i]} computed tokens its {W}-token window starts at position {lo}")
        return out


__all__ = ["PoisonPlan", "bits"]
