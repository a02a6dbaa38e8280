"""Speculative decoding in stages 2 and 8: drafts into the rows, verified tokens out.

Stage 2 (:func:`write_spec_tokens`, last in ``apply_update``, after every row move): each
verifying row's ``d`` drafts go into ``token_ids_cpu[row, num_tokens : num_tokens + d]``
(vLLM's ``spec_token_ids``) and ``num_spec_tokens[row] = d``; ``num_tokens`` stays the
count of real tokens. Stage 3 then reads the drafts like any other scheduled token:
``input_ids``, ``positions``, ``seq_lens = num_computed_tokens + 1 + d`` and a slot for
every draft position come out of the unchanged ``prepare_inputs`` (both paths).

Stage 8 (:func:`append_verified_tokens`): a verifying row emitted ``a + 1`` tokens
(``a <= d`` accepted drafts, then the corrected or bonus token). They are written from
``num_tokens`` on (over the drafts), ``num_tokens`` grows by ``a + 1`` and the row's
drafts are gone. The rejected drafts' K/V slots (positions ``num_tokens + a + 1 ..``) are
dead: the scheduler's next ``num_computed_tokens`` (rolled back by the rejected count)
makes the next step write its own tokens there, and no query reads past its ``seq_lens``.

State groups (:func:`draft_state_copies`): a verifying row's states after each position sit
in its block-table columns ``0 .. d``; the slots to copy so that column 0 holds the state at
the accepted length (``runner/execute/spec_decode/state_commit.py`` copies them).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from attnplug.cache_groups.ragged import cumsum_and_arange
from attnplug.core.errors import MetadataError
from attnplug.runner.step.append import token_id_array
from attnplug.runner.step.plan import SpecTokens
from attnplug.runner.step.check.types import row_indices, rows_distinct
from attnplug.runner.step.input_batch import InputBatch


def write_spec_tokens(batch: InputBatch, spec_tokens: SpecTokens | None, rows_moved: bool = True) -> None:
    """Stage 2: clear the previous step's draft counts, write this step's drafts (the
    kernels' ``write_drafts``). ``rows_moved``: stage 2 moved a row since stage 1 (then
    ``spec_tokens.rows`` is stale and the ids are looked up)."""
    if spec_tokens is None:
        batch.kernels.write_drafts(batch, None, None, None)
        batch.drafts_written = False
        return
    batch.drafts_written = True
    ids = spec_tokens.req_ids
    if spec_tokens.rows is not None and not rows_moved:
        rows = spec_tokens.rows
    else:
        rows = np.fromiter(map(batch.req_id_to_index.__getitem__, ids), np.int64, len(ids))
    batch.kernels.write_drafts(batch, rows, spec_tokens.lens, spec_tokens.flat)


def append_verified_tokens(batch: InputBatch, max_model_len: int, rows: Sequence[int],
                           token_ids: Sequence[Sequence[int]]) -> None:
    """Stage 8 of a step with drafts: append each row's emitted tokens (validated first).

    Args:
        batch: the step's batch.
        max_model_len: tokens a request may hold.
        rows: ``[n]`` distinct batch rows whose logits are not discarded.
        token_ids: per row, ``1 .. 1 + num_spec_tokens[row]`` token ids (accepted drafts,
            then the corrected or bonus token).

    Raises:
        MetadataError: a bad or repeated row, a discarded row (``seq_lens`` short of
            ``num_tokens + drafts``), a row with no tokens or more than ``1 + d``, a token
            id outside ``[0, 2**31)``, more than ``max_model_len`` tokens. Nothing changes.
    """
    b = batch
    r = row_indices(rows, "append_verified_tokens")
    n = r.shape[0]
    m = len(token_ids) if hasattr(token_ids, "__len__") else token_ids
    if m != n:
        raise MetadataError(f"append_verified_tokens: {m!r} token lists for {n} rows")
    if n == 0:
        return
    if b.kernels.append_verified(b, r, max_model_len, token_ids):  # checks and writes, or declines
        return
    if r.min() < 0 or r.max() >= b.num_reqs or not rows_distinct(r, b.num_reqs):
        raise MetadataError(f"append_verified_tokens: rows must be distinct and in [0, {b.num_reqs}), "
                            f"got {r.tolist()}")
    lens = np.fromiter(map(len, token_ids), np.int64, n)
    d = b.num_spec_tokens[r].astype(np.int64)
    held = b.num_tokens[r].astype(np.int64)
    seq = b.num_computed_tokens_cpu[r].astype(np.int64) + b.num_scheduled_tokens[r]
    bad = np.flatnonzero((seq != held + d) | (lens < 1) | (lens > d + 1) | (held + lens > max_model_len))
    if bad.shape[0]:
        i = int(bad[0])
        rid = b._req_ids[r[i]]
        raise MetadataError(
            f"append_verified_tokens: request {rid!r}: {int(lens[i])} tokens for a row with {int(d[i])} "
            f"drafts, seq_len {int(seq[i])}, num_tokens {int(held[i])} (need 1 .. 1 + drafts tokens, a row "
            f"whose logits are not discarded, and at most max_model_len={max_model_len} tokens)")
    flat = token_id_array(b.kernels, token_ids if type(token_ids) is list else list(token_ids), int(lens.sum()),
                          "append_verified_tokens", token_ids)
    _, offsets = cumsum_and_arange(lens)
    b.token_ids_cpu[np.repeat(r, lens), np.repeat(held, lens) + offsets] = flat
    b.num_tokens[r] = held + lens
    b.num_spec_tokens[r] = 0


def draft_state_copies(tables: Sequence[np.ndarray], rows: Sequence[int], tokens: Sequence[Sequence[int]]
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per state group, ``(src_slots, dst_slots)`` (``int64``) of the rows that accepted drafts.

    Args:
        tables: per state group, its host block table ``[max_num_reqs, width]`` (manager ids).
        rows: the verified rows (batch rows of this step).
        tokens: per row, the emitted tokens (``a + 1`` of them).
    """
    r = np.asarray(rows, dtype=np.int64)
    a = np.fromiter(map(len, tokens), np.int64, len(tokens)) - 1
    sel = np.flatnonzero(a > 0)
    return [(t[r[sel], a[sel]].astype(np.int64), t[r[sel], 0].astype(np.int64)) for t in tables]
