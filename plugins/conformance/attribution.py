"""Which NaN-poisoned KV-cache blocks a backend read, found by rerunning the case.

When a step's output holds NaN, the backend read a block it must not (``poison.py``).
To name it, the case is rerun up to that step with NaN in only a subset of those blocks
(the rest hold the finite poison), halving the subsets that still give NaN (adaptive
group testing: about ``2 * r * log2(n)`` reruns for ``r`` blocks read out of ``n``). A
backend whose output is not a deterministic function of its inputs may make the answer
incomplete; the message then says so.
"""

from __future__ import annotations

import torch

from attnplug.plugins.conformance.harness import CaseRun, run_case

MAX_RERUNS = 64
"""Most reruns spent naming the blocks of one failure."""


def _has_nan(run: CaseRun, subset: list[int], step: int, group: int) -> bool:
    rerun = run_case(run.backend, run.case, run.device, run.kernel_block_size,
                     nan_only=frozenset((group, kb) for kb in subset), stop_after=step)
    if rerun.error or len(rerun.steps) <= step:
        return False
    return bool(torch.isnan(rerun.steps[step].groups[group].output).any())


def blocks_read(run: CaseRun, step: int, group: int) -> tuple[list[str], bool]:
    """The NaN blocks whose poison reaches ``step``'s output in cache ``group``.

    Args:
        run: a finished run (``run.backend`` set) whose step ``step`` output is NaN.
        step, group: where the NaN output is.

    Returns:
        ``(descriptions, complete)``: one sentence per block read (its id and why it held
        NaN), and whether every candidate was resolved within :data:`MAX_RERUNS`.
    """
    why: dict[int, str] = {}
    for record in run.steps[:step + 1]:
        why.update(record.poisoned[group])
    budget = [MAX_RERUNS]
    found: list[int] = []
    complete = True

    def search(cands: list[int], known_nan: bool) -> None:
        nonlocal complete
        if not cands:
            return
        if not known_nan:
            if budget[0] <= 0:
                complete = False
                return
            budget[0] -= 1
            if not _has_nan(run, cands, step, group):
                return
        if len(cands) == 1:
            found.append(cands[0])
            return
        half = len(cands) // 2
        search(cands[:half], False)
        search(cands[half:], False)

    if run.backend is not None:
        search(sorted(why), True)
    return [why[kb] for kb in sorted(found)], complete and bool(found)
