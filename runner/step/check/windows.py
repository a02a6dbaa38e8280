"""Stage 1, sliding windows: no scheduled position of a cached request may fall in a
block the sliding window already released.

A sliding-window group's leading blocks are freed by the block pool (and nulled in the
runner's table by ``runner/step/apply_windows.py``) once no query can see them. A request
that goes back to recompute those positions must come back ``resumed_from_preemption``
with fresh block ids; these checks reject it otherwise.
"""

from __future__ import annotations

import numpy as np

from attnplug.cache_groups.ragged import cumsum_and_arange
from attnplug.cache_groups.sliding_window import num_skipped_blocks
from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.step.check.types import err
from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.input_batch import InputBatch
from attnplug.runner.step.request_state import CachedRequestState


def check_not_behind_nulled(lay: StepLayout, batch: InputBatch, C: list, rows_c: np.ndarray,
                            ncts_c: np.ndarray, resumed: set[int]) -> None:
    """A non-resumed cached request whose ``num_computed_tokens`` went back (without a
    preemption) must not reach a sliding-window block the runner already nulled: not with
    a scheduled position, nor with a key its first query sees (from
    ``max(0, num_computed_tokens - W + 1)`` on). So the blocks it may see start at
    ``num_skipped_blocks(num_computed_tokens)``, and those the runner nulled end at
    ``num_skipped_blocks(num_computed_tokens_nulled)``."""
    done = batch.num_computed_tokens_nulled[rows_c]  # rows_c -1 (re-added rows): masked below
    if not (ncts_c < done).any():  # the common case: nobody went back
        return
    check = rows_c >= 0
    if resumed:
        check[list(resumed)] = False
    for g, window in enumerate(lay.sliding_windows):
        if window is None:
            continue
        B = lay.block_sizes[g]
        nulled = num_skipped_blocks(done, window, B)
        bad = check & (nulled > num_skipped_blocks(ncts_c, window, B))
        if bad.any():
            i = int(np.argmax(bad))
            first = max(0, int(ncts_c[i]) - window + 1)
            err(C[i], "num_computed_tokens", f"group {g}: {int(ncts_c[i])} is behind the sliding window the "
                f"runner already applied ({int(done[i])} tokens computed, window {window}): its queries see "
                f"keys from position {first} on, but blocks [0, {int(nulled[i])}) of {B} tokens were freed "
                "and nulled; a request that recomputes must be resumed_from_preemption with fresh block ids")


def check_span_not_null(lay: StepLayout, batch: InputBatch, requests: dict[str, CachedRequestState], C: list,
                        rows_c: np.ndarray, ncts_c: np.ndarray, seq_c: np.ndarray, before: np.ndarray,
                        readd: list[int], resumed: set[int]) -> None:
    """No scheduled position of a cached request may fall in a ``NULL_BLOCK_ID`` its row
    already holds (a sliding-window group's skipped prefix, sent by the scheduler or
    nulled by the runner): a request that goes back to recompute must be resumed with
    fresh blocks. Appended blocks are never null (checked with the appends); resumed
    requests' fresh lists are checked with ``check_block_list``."""
    for g, allowed in enumerate(lay.null_block_allowed):
        if not allowed:
            continue
        B = lay.block_sizes[g]
        first = ncts_c // B
        cnt = np.minimum((seq_c - 1) // B, before[g].astype(np.int64) - 1) - first + 1
        np.maximum(cnt, 0, out=cnt)
        cnt[rows_c < 0] = 0  # re-added rows: checked below from their state
        if resumed:
            cnt[list(resumed)] = 0
        bad = None
        if cnt.any():
            _, offs = cumsum_and_arange(cnt)
            owner = np.repeat(np.arange(cnt.shape[0]), cnt)
            hit = batch.block_table[g].block_table_np[rows_c[owner], first[owner] + offs] == NULL_BLOCK_ID
            if hit.any():
                bad = int(owner[np.argmax(hit)])
        window = lay.sliding_windows[g]
        for i in readd:  # their state: from the first key a query sees (the window's) on
            if bad is None and i not in resumed:
                ids = requests[C[i]].block_ids_np()[g]
                lo = int(first[i]) if window is None else max(0, int(ncts_c[i]) - window + 1) // B
                if (ids[lo:(int(seq_c[i]) - 1) // B + 1] == NULL_BLOCK_ID).any():
                    bad = i
        if bad is not None:
            err(C[bad], "num_computed_tokens", f"group {g}: positions [{int(ncts_c[bad])}, {int(seq_c[bad])}) fall "
                "in the null block (a skipped sliding-window prefix); a request that recomputes must be "
                "resumed_from_preemption with fresh block ids")
