"""Validation of ``scheduled_new_reqs``: checks and conversion, no mutation.

Part of the validate phase of ``update_states``: every new request's prompt (and
re-sent outputs), block ids and counts are checked, converted to ``int32`` arrays in two
batched ``IntPacker`` calls (prompts, block ids) and wrapped in detached
:class:`CachedRequestState` objects that ``apply_update`` then admits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

import numpy as np

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import NewRequestData, SamplingParams

if TYPE_CHECKING:
    from attnplug.runner.step.compiler import StepCompiler


def err(req_id: Any, field_name: str, message: str) -> NoReturn:
    """Raise :class:`InvalidSchedulerOutput` (the runner state is untouched at this point)."""
    raise InvalidSchedulerOutput(req_id, field_name, message)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _real(x: Any) -> float | None:
    """``x`` as a finite float, or ``None`` (not a real number, a bool, or not finite)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        return None
    try:
        v = float(x)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def check_sampling(req_id: str, sp: Any) -> None:
    """``sp`` is a :class:`SamplingParams` the batch columns can hold: a ``temperature``
    in ``[0, float32 max]``, finite ``top_p`` in ``(0, 1]``, an ``int32`` ``top_k``, and a
    ``seed`` that is ``None`` or an int ``torch.Generator.manual_seed`` accepts."""
    if not isinstance(sp, SamplingParams):
        err(req_id, "sampling_params", f"expected SamplingParams, got {type(sp).__name__}")
    t, p = _real(sp.temperature), _real(sp.top_p)
    if t is None or not 0 <= t <= FLOAT32_MAX:
        err(req_id, "sampling_params", f"temperature must be a number in [0, {FLOAT32_MAX:.4g}] (0 is greedy; "
            f"the batch column is float32), got {sp.temperature!r}")
    if p is None or not 0 < p <= 1:
        err(req_id, "sampling_params", f"top_p must be a number in (0, 1], got {sp.top_p!r}")
    k = sp.top_k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not -2**31 <= k < 2**31:
        err(req_id, "sampling_params", f"top_k must be an int32 (<= 0 disables it), got {k!r}")
    seed = sp.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or not -2**63 <= seed < 2**64):
        err(req_id, "sampling_params", f"seed must be None or an int in [-2**63, 2**64), got {seed!r}")


def check_block_list(sc: "StepCompiler", req_id: str, fname: str, g: int, ids: np.ndarray,
                     start: int, seq_len: int) -> None:
    """An initial or replacement block list of group ``g`` for a request that computes
    positions ``[start, seq_len)`` this step: length, pool range, null blocks."""
    n = ids.shape[0]
    B = sc.block_sizes[g]
    if n > sc.max_num_blocks_per_req[g]:
        err(req_id, fname, f"group {g}: {n} blocks but a request holds at most "
            f"{sc.max_num_blocks_per_req[g]} (cdiv(max_model_len={sc.max_model_len}, block_size={B}))")
    if sc.group_kinds[g] != "mamba" and n * B < seq_len:
        err(req_id, fname, f"group {g}: {n} blocks of {B} tokens cannot hold seq_len {seq_len} "
            "(num_computed_tokens + num_scheduled_tokens); the block table is too short")
    pool = sc.num_blocks_per_group[g]
    if n and (int(ids.min()) <= NULL_BLOCK_ID or int(ids.max()) >= pool):
        low = NULL_BLOCK_ID if sc.null_block_allowed[g] else NULL_BLOCK_ID + 1
        bad = ids[(ids < low) | (ids >= pool)]
        if bad.shape[0]:
            why = ("the reserved null block, legitimate only in a sliding-window group's skipped prefix"
                   if int(bad[0]) == NULL_BLOCK_ID else "outside the pool")
            err(req_id, fname, f"group {g}: block id {int(bad[0])} is {why}; valid ids are [{low}, {pool})")
        span = ids[start // B:(seq_len - 1) // B + 1] if seq_len > start else ids[:0]
        if (span == NULL_BLOCK_ID).any():
            err(req_id, fname, f"group {g}: positions [{start}, {seq_len}) fall in the null block; only "
                "blocks no query can see may be null")


def group_lists(sc: "StepCompiler", req_id: str, fname: str, value: Any) -> Sequence[Sequence[int]]:
    """``value`` as one block-id list per cache group."""
    if not isinstance(value, (tuple, list)) or len(value) != sc.num_groups:
        err(req_id, fname, f"expected one block-id list per cache group ({sc.num_groups}), got {value!r}")
    for g, ids in enumerate(value):
        if not isinstance(ids, (tuple, list, np.ndarray)):
            err(req_id, fname, f"group {g}: expected a list of block ids, got {ids!r}")
    return value


def plan_new_requests(sc: "StepCompiler", new_reqs: Sequence[NewRequestData],
                      new_counts: Sequence[int]) -> list[CachedRequestState]:
    """Check the new requests and build their (detached) states.

    Args:
        sc: the step compiler (limits and packers).
        new_reqs: ``scheduler_output.scheduled_new_reqs`` (ids already checked).
        new_counts: their ``num_scheduled_tokens`` (already checked ``>= 1``).

    Raises:
        InvalidSchedulerOutput: an empty or too long prompt, a token id that is not an int
            in ``[0, 2**31)``, a bad ``num_computed_tokens``, too few tokens for the count,
            bad block ids or too few blocks, bad sampling params.
    """
    if not new_reqs:
        return []
    G = sc.num_groups
    seqs, owners, block_lists = [], [], []
    for i, nr in enumerate(new_reqs):
        for fname in ("prompt_token_ids", "output_token_ids"):
            if not isinstance(getattr(nr, fname), (list, tuple, np.ndarray)):
                err(nr.req_id, fname, f"expected a list of token ids, got {getattr(nr, fname)!r}")
        if not len(nr.prompt_token_ids):
            err(nr.req_id, "prompt_token_ids", "prompt is empty; a request needs at least one token")
        seqs.append(nr.prompt_token_ids)
        owners.append((i, "prompt_token_ids"))
        if len(nr.output_token_ids):
            seqs.append(nr.output_token_ids)
            owners.append((i, "output_token_ids"))
        block_lists.extend(group_lists(sc, nr.req_id, "block_ids", nr.block_ids))
    toks = sc._prompt_packer.pack(seqs)
    if isinstance(toks, int):
        i, fname = owners[toks]
        err(new_reqs[i].req_id, fname, "token ids must be ints in [0, 2**31)")
    blocks = sc._block_packer.pack(block_lists)
    if isinstance(blocks, int):
        err(new_reqs[blocks // G].req_id, "block_ids", f"group {blocks % G}: block ids must be ints in [0, 2**31)")
    packer = sc._block_packer
    suspicious = packer.min <= NULL_BLOCK_ID or packer.max >= sc.num_blocks
    states, k = [], 0
    max_len = sc.max_model_len
    # per group: blocks a row holds at most, and tokens a block covers (0: any, Mamba)
    limits = [(m, 0 if kind == "mamba" else b) for m, b, kind in
              zip(sc.max_num_blocks_per_req, sc.block_sizes, sc.group_kinds)]
    for i, (nr, cnt) in enumerate(zip(new_reqs, new_counts)):
        rid = nr.req_id
        tokens = toks[k]
        k += 1
        if len(nr.output_token_ids):
            tokens = np.concatenate((tokens, toks[k]))
            k += 1
        held = tokens.shape[0]
        if held > max_len:
            err(rid, "prompt_token_ids", f"request holds {held} tokens but max_model_len is {max_len}")
        ncts = nr.num_computed_tokens
        if type(ncts) is not int and (not isinstance(ncts, (int, np.integer)) or isinstance(ncts, bool)) or ncts < 0:
            err(rid, "num_computed_tokens", f"must be an int >= 0, got {ncts!r}")
        ncts = int(ncts)
        seq = ncts + cnt
        if seq > held:
            err(rid, "num_scheduled_tokens", f"schedules positions [{ncts}, {seq}) but the request holds "
                f"only {held} tokens")
        arrs = tuple(blocks[i * G:(i + 1) * G])
        for g, (a, (most, per_block)) in enumerate(zip(arrs, limits)):
            n = a.shape[0]
            if suspicious or n > most or n * per_block < seq and per_block:
                check_block_list(sc, rid, "block_ids", g, a, ncts, seq)
        sp = nr.sampling_params
        check_sampling(rid, sp)
        states.append(CachedRequestState(rid, nr.prompt_token_ids, arrs, ncts, sp, token_ids_np=tokens,
                                         block_ids_np=arrs))
    return states
