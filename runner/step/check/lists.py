"""Stage 1 helpers: checks of one block-id list.

Shared by the checks of new requests (``check.new``) and of cached requests' block
deltas (``check.blocks``).
"""

from __future__ import annotations

from typing import Any, Sequence

from itertools import accumulate

import numpy as np

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.step.check.types import err, int64_list, is_int_list, show
from attnplug.runner.step.groups import INT32_MAX, StepLayout

__all__ = ["block_id_array", "check_block_list", "err", "group_lists", "repeated_block", "repeated_block_message",
           "repeated_pair"]


def group_lists(lay: StepLayout, req_id: str, fname: str, value: Any) -> Sequence[Sequence[int]]:
    """``value`` as one block-id list per cache group.

    Raises:
        InvalidSchedulerOutput: not a tuple/list with one list (or 1-D array) per group.
    """
    if not isinstance(value, (tuple, list)) or len(value) != lay.num_groups:
        err(req_id, fname, f"expected one block-id list per cache group ({lay.num_groups}), got {show(value)}")
    for g, ids in enumerate(value):
        if not is_int_list(ids):
            err(req_id, fname, f"group {g}: expected a list of block ids (or a 1-D integer array), got {show(ids)}")
    return value


def block_id_array(rid: Any, fname: str, g: int, ids) -> np.ndarray:
    """``ids`` (one group's list, checked by :func:`group_lists`) as ``[n]`` ``int32``, each
    in ``[0, 2**31)``.

    Raises:
        InvalidSchedulerOutput: an entry that is not an int (a bool, float or string), or
            out of range.
    """
    if isinstance(ids, np.ndarray):
        a = ids.astype(np.int64) if ids.dtype != np.uint64 or not ids.size or ids.max() <= INT32_MAX else None
    else:
        a = int64_list(ids)
    if a is None:
        err(rid, fname, f"group {g}: block ids must be a list of ints, got {show(ids)}")
    if a.shape[0] and (a.min() < 0 or a.max() > INT32_MAX):
        err(rid, fname, f"group {g}: block ids must be in [0, 2**31), got {a.tolist()}")
    return a.astype(np.int32)


def check_block_list(lay: StepLayout, req_id: str, fname: str, g: int, ids: np.ndarray,
                     start: int, seq_len: int) -> None:
    """An initial or replacement block list of group ``g`` for a request that computes
    positions ``[start, seq_len)`` this step: length, pool range, null blocks.

    Every block a query of the step can see must be a real block: for a full-attention
    group all of them; for a sliding-window group of known window ``W`` those from
    position ``max(0, start - W + 1)`` on (the null block may stand only before: the
    skipped prefix); a Mamba group needs its state slot (one block id) from the first step.
    Later steps keep this true by construction (appends are never null, the runner nulls
    only blocks no query can see again), so a cached request is checked only for what it
    adds (``check.blocks``, ``check.windows``).

    Raises:
        InvalidSchedulerOutput: more blocks than ``cdiv(max_model_len, block_size)``, too
            few to hold ``seq_len`` (a Mamba group: no state slot), an id outside the pool,
            the null block where it is not legitimate or where a query of this step looks.
    """
    n = ids.shape[0]
    B = lay.block_sizes[g]
    if n > lay.max_num_blocks_per_req[g]:
        err(req_id, fname, f"group {g}: {n} blocks but a request holds at most "
            f"{lay.max_num_blocks_per_req[g]} (cdiv(max_model_len={lay.max_model_len}, block_size={B}))")
    if n * int(lay.capacity_col[g, 0]) < seq_len:
        if not lay.groups[g].writes_slots:
            err(req_id, fname, f"group {g}: a Mamba state group's request needs its state slot (one block id) "
                "from its first step; got none")
        err(req_id, fname, f"group {g}: {n} blocks of {B} tokens cannot hold seq_len {seq_len} "
            "(num_computed_tokens + num_scheduled_tokens); the block table is too short")
    pool = lay.num_blocks_per_group[g]
    if n and (int(ids.min()) <= NULL_BLOCK_ID or int(ids.max()) >= pool):
        low = NULL_BLOCK_ID if lay.null_block_allowed[g] else NULL_BLOCK_ID + 1
        bad = ids[(ids < low) | (ids >= pool)]
        if bad.shape[0]:
            why = ("the reserved null block, legitimate only in a sliding-window group's skipped prefix"
                   if int(bad[0]) == NULL_BLOCK_ID else "outside the pool")
            err(req_id, fname, f"group {g}: block id {int(bad[0])} is {why}; valid ids are [{low}, {pool})")
        window = lay.sliding_windows[g]
        first = start if window is None else max(0, start - window + 1)
        span = ids[first // B:(seq_len - 1) // B + 1] if seq_len > start else ids[:0]
        if (span == NULL_BLOCK_ID).any():
            seen = f"positions [{first}, {seq_len})" + ("" if window is None else
                                                       f" (the window of {window} tokens of this step's queries)")
            err(req_id, fname, f"group {g}: {seen} fall in the null block; only blocks no query can see "
                "may be null")


def repeated_block(flat: np.ndarray, lens: Sequence[int] | np.ndarray) -> tuple[int, int] | None:
    """The first list (of lists packed back to back in ``flat``) that holds one real block
    id twice, and that id; ``None`` when every list's real ids are distinct.

    A block id repeated in one request's list of one group gives two positions one block,
    so two real tokens write one slot (vLLM's block tables never do it); the same id in
    two requests' lists is prefix sharing and legal. ``NULL_BLOCK_ID`` (a skipped
    sliding-window prefix) may repeat.

    Args:
        flat: ``[sum(lens)]`` integer block ids.
        lens: ``[num_lists]`` the lists' lengths.

    Cost: one compare when the ids of every list ascend and descend only where a list ends
    (the block pool's usual order); a few vectorized ones when a list starts with nulls;
    else one sort of ``(list, id)`` keys.
    """
    n = flat.shape[0]
    if n < 2:
        return None
    # the usual case: ids ascend inside every list, so the only descents are at list ends
    descent = flat[1:] <= flat[:-1]
    num = _count(descent)
    if num == 0:
        return None
    if num < len(lens):
        cuts = list({e - 1 for e in accumulate(lens) if 0 < e < n})  # the last index of each list but the end
        if cuts and _count(descent[cuts]) == num:
            return None
    ids = flat.astype(np.int64)
    ends = np.cumsum(np.asarray(lens, dtype=np.int64))
    # the pairs (t, t + 1) inside one list; a real id must exceed its predecessor unless
    # that one is null (null < every real id, so real ids then ascend strictly)
    inner = np.ones(n - 1, dtype=bool)
    cut = ends[(ends > 0) & (ends < n)] - 1
    inner[cut] = False
    if not (inner & (ids[1:] <= ids[:-1]) & (ids[:-1] != NULL_BLOCK_ID)).any():
        return None
    owner = np.repeat(np.arange(ends.shape[0], dtype=np.int64), np.diff(ends, prepend=0))
    return repeated_pair(owner, ids)


_count = np.count_nonzero


def repeated_pair(owner: np.ndarray, ids: np.ndarray) -> tuple[int, int] | None:
    """The lowest ``owner`` holding one real block id twice among the pairs
    ``(owner[t], ids[t])`` (any order), and that id; ``None`` when there is none.

    Args:
        owner: ``[n]`` ``int64`` list indices ``>= 0``.
        ids: ``[n]`` integer block ids in ``[0, 2**31)``; ``NULL_BLOCK_ID`` may repeat.
    """
    ids = ids.astype(np.int64, copy=False)
    real = ids != NULL_BLOCK_ID
    keys = np.sort((owner[real].astype(np.int64) << 32) | ids[real])
    dup = keys[1:] == keys[:-1]
    if not dup.any():
        return None
    key = int(keys[1:][dup].min())  # the lowest list first
    return key >> 32, key & 0xFFFFFFFF


def repeated_block_message(g: int, block_id: int) -> str:
    """The refusal of a block id repeated in one request's list of group ``g``."""
    return (f"group {g}: block id {block_id} appears twice in the request's block list: two positions "
            "would share one block, so two tokens would write one slot (the same id may appear in "
            "different requests' lists, prefix sharing, never twice in one)")
