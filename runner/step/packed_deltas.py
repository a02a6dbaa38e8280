"""The cached requests' drafts and block appends between their two forms.

vLLM's form: ``SchedulerOutput.scheduled_spec_decode_tokens`` (``{req_id: [draft ids]}``)
and ``CachedRequestData.new_block_ids`` (per request ``None`` or a tuple of per-group id
lists). The packed form: :class:`~attnplug.runner.step.scheduler_output.PackedCachedDeltas`
(count arrays aligned with ``req_ids``, flat ``int32`` ids). ``update_states`` takes
either; these functions convert (the scheduler, the benches and the tests use
:func:`pack_cached_deltas`; stage 1's vectorized checks :func:`unpack_cached_deltas`;
readers of a whole output that want vLLM's form :func:`draft_tokens` and
:func:`as_vllm_form`).
"""

from __future__ import annotations

import dataclasses
from itertools import chain

import numpy as np

from attnplug.runner.step.scheduler_output import CachedRequestData, PackedCachedDeltas, SchedulerOutput


def pack_cached_deltas(cached: CachedRequestData, spec: dict, num_groups: int, *, copy: bool = True
                       ) -> tuple[CachedRequestData, PackedCachedDeltas]:
    """``(cached', packed)``: ``cached`` with ``new_block_ids`` ``None`` for every request
    that is not resumed and the drafts of ``spec`` and those appends as arrays. The caller
    sends ``cached'``, ``packed`` and an empty ``scheduled_spec_decode_tokens``.

    Args:
        cached: vLLM's form of the cached requests' deltas (valid: the values are not checked).
        spec: ``{req_id: [draft token ids]}`` of cached requests.
        num_groups: ``G``, the cache groups (``new_block_ids`` entries hold ``G`` lists).
        copy: ``cached'`` is a new ``CachedRequestData`` (its lists copied; ``cached`` is not
            changed); ``False``: ``cached`` itself, its ``new_block_ids`` entries replaced
            in place (the scheduler's own output).
    """
    C = cached.req_ids
    nd = np.fromiter((len(spec.get(rid, ())) for rid in C), np.int32, len(C))
    drafts = np.fromiter(chain.from_iterable(spec.get(rid, ()) for rid in C), np.int32, int(nd.sum()))
    nb = np.zeros((num_groups, len(C)), np.int32)
    ids: list[list[int]] = [[] for _ in range(num_groups)]
    kept = []
    for i, (e, resumed) in enumerate(zip(cached.new_block_ids, cached.resumed_from_preemption)):
        if e is None or resumed:
            kept.append(e)
            continue
        kept.append(None)
        for g in range(num_groups):
            nb[g, i] = len(e[g])
            ids[g].extend(e[g])
    flat = np.fromiter(chain.from_iterable(ids), np.int32, int(nb.sum()))
    if copy:
        cached = CachedRequestData(list(C), list(cached.resumed_from_preemption), list(cached.new_token_ids), kept,
                                   list(cached.num_computed_tokens))
    else:
        cached.new_block_ids[:] = kept
    return cached, PackedCachedDeltas(nd, drafts, nb, flat)


def unpack_cached_deltas(req_ids: list, new_block_ids: list, packed: PackedCachedDeltas
                         ) -> tuple[dict[str, list[int]], list]:
    """``(spec, new_block_ids')``: the packed drafts as vLLM's dict (requests with 0 drafts
    left out) and ``new_block_ids`` with each appending request's entry a tuple of per-group
    lists (requests that append nothing keep their entry). Arrays already checked against
    each other (``check/packed.py``); the values are not checked here."""
    nd, nb = packed.num_draft_tokens, packed.num_new_blocks
    spec: dict[str, list[int]] = {}
    if nd.shape[0] and nd.any():
        drafts, counts = packed.draft_token_ids.tolist(), nd.tolist()
        off = 0
        for i in np.flatnonzero(nd).tolist():
            n = counts[i]
            spec[req_ids[i]] = drafts[off:off + n]
            off += n
    out = list(new_block_ids)
    G = nb.shape[0]
    if not G or not nb.any():
        return spec, out
    appending = np.flatnonzero(nb.any(axis=0)).tolist()
    flat = packed.new_block_ids.tolist()
    start = 0
    per_group = []  # per group: the appending requests' (start, end) in flat
    for g in range(G):
        ends = (np.cumsum(nb[g], dtype=np.int64) + start)[appending].tolist()
        lens = nb[g][appending].tolist()
        per_group.append([(e - L, e) for e, L in zip(ends, lens)])
        start += int(nb[g].sum(dtype=np.int64))
    for j, i in enumerate(appending):
        out[i] = tuple(flat[a:b] for a, b in (per_group[g][j] for g in range(G)))
    return spec, out


def draft_tokens(out: SchedulerOutput) -> dict[str, list[int]]:
    """The drafts of ``out`` as vLLM's ``{req_id: [draft ids]}`` whichever form it carries
    (requests without drafts left out; for readers of the output other than the step
    compiler: the scheduler's bookkeeping, tests)."""
    pk = out.packed_cached
    if pk is None:
        return out.scheduled_spec_decode_tokens
    C, nd = out.scheduled_cached_reqs.req_ids, pk.num_draft_tokens
    if not nd.any():
        return {}
    ids, offs = pk.draft_token_ids.tolist(), np.concatenate(([0], np.cumsum(nd, dtype=np.int64))).tolist()
    return {C[i]: ids[offs[i]:offs[i + 1]] for i in np.flatnonzero(nd).tolist()}


def as_vllm_form(out: SchedulerOutput) -> SchedulerOutput:
    """``out`` in vLLM's form (a new output sharing the other fields; ``out`` itself when it
    carries no packed deltas)."""
    pk = out.packed_cached
    if pk is None:
        return out
    c = out.scheduled_cached_reqs
    spec, blocks = unpack_cached_deltas(c.req_ids, c.new_block_ids, pk)
    cached = CachedRequestData(list(c.req_ids), list(c.resumed_from_preemption), list(c.new_token_ids), blocks,
                               list(c.num_computed_tokens))
    return dataclasses.replace(out, scheduled_cached_reqs=cached, scheduled_spec_decode_tokens=spec,
                               packed_cached=None)
