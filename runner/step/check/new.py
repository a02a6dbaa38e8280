"""Stage 1, new requests: check ``scheduled_new_reqs`` and convert them; change nothing.

Every new request's prompt (and re-sent outputs), block ids and counts are checked,
converted to ``int32`` arrays in two batched ``IntPacker`` calls (prompts, block ids)
and wrapped in detached :class:`CachedRequestState` objects that stage 2
(``runner/step/apply.py``) admits.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.step.check.lists import check_block_list, err, group_lists, repeated_block, repeated_block_message
from attnplug.runner.step.check.snapshot import NewReq
from attnplug.runner.step.check.types import is_int, show
from attnplug.runner.step.groups import StepLayout
from attnplug.runner.step.int_packer import IntPacker
from attnplug.runner.step.request_state import CachedRequestState
from attnplug.runner.step.scheduler_output import SamplingParams

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
    t, p, k, seed = sp.temperature, sp.top_p, sp.top_k, sp.seed
    if (type(t) is float and 0 <= t <= FLOAT32_MAX and type(p) is float and 0 < p <= 1  # (NaN fails these)
            and type(k) is int and -2**31 <= k < 2**31 and seed is None):
        return  # the usual parameters, exact types: the checks below would pass them
    tv, pv = _real(t), _real(p)
    if tv is None or not 0 <= tv <= FLOAT32_MAX:
        err(req_id, "sampling_params", f"temperature must be a number in [0, {FLOAT32_MAX:.4g}] (0 is greedy; "
            f"the batch column is float32), got {t!r}")
    if pv is None or not 0 < pv <= 1:
        err(req_id, "sampling_params", f"top_p must be a number in (0, 1], got {p!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not -2**31 <= k < 2**31:
        err(req_id, "sampling_params", f"top_k must be an int32 (<= 0 disables it), got {k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or not -2**63 <= seed < 2**64):
        err(req_id, "sampling_params", f"seed must be None or an int in [-2**63, 2**64), got {seed!r}")


def plan_new_requests(lay: StepLayout, prompt_packer: IntPacker, block_packer: IntPacker,
                      new_reqs: Sequence[NewReq], new_counts: Sequence[int]) -> list[CachedRequestState]:
    """Check the new requests and build their (detached) states.

    Args:
        lay: the step layout (limits, groups).
        prompt_packer, block_packer: the packers for prompts and block ids (their views
            stay valid until the next step's stage 1).
        new_reqs: ``scheduler_output.scheduled_new_reqs`` (ids already checked).
        new_counts: their ``num_scheduled_tokens`` (already checked ``>= 1``).

    Raises:
        InvalidSchedulerOutput: an empty or too long prompt, a token id that is not an int
            in ``[0, 2**31)``, a bad ``num_computed_tokens``, too few tokens for the count,
            bad block ids or too few blocks, a block id twice in one list, bad sampling params.
    """
    if not new_reqs:
        return []
    G = lay.num_groups
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
        block_lists.extend(group_lists(lay, nr.req_id, "block_ids", nr.block_ids))
    toks = prompt_packer.pack(seqs)
    if isinstance(toks, int):
        i, fname = owners[toks]
        err(new_reqs[i].req_id, fname, "token ids must be ints in [0, 2**31)")
    blocks = block_packer.pack(block_lists)
    if isinstance(blocks, int):
        err(new_reqs[blocks // G].req_id, "block_ids", f"group {blocks % G}: block ids must be ints in [0, 2**31)")
    packer = block_packer
    suspicious = packer.min <= NULL_BLOCK_ID or packer.max >= lay.num_blocks
    states, k = [], 0
    max_len = lay.max_model_len
    # per group: blocks a row holds at most, and tokens a block covers (0: any, Mamba)
    limits = [(m, g.tokens_per_block(max_len)) for m, g in zip(lay.max_num_blocks_per_req, lay.groups)]
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
            if suspicious or n > most or n * per_block < seq:
                check_block_list(lay, rid, "block_ids", g, a, ncts, seq)
        sp = nr.sampling_params
        check_sampling(rid, sp)
        states.append(CachedRequestState(rid, nr.prompt_token_ids, arrs, ncts, sp, token_ids_np=tokens,
                                         block_ids_np=arrs))
    dup = repeated_block(packer.flat, [a.shape[0] for a in blocks])
    if dup is not None:
        err(new_reqs[dup[0] // G].req_id, "block_ids", repeated_block_message(dup[0] % G, dup[1]))
    return states
