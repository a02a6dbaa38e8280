"""Stage 1, the packed form of drafts and block appends (``PackedCachedDeltas``).

:func:`read_packed` reads the four arrays once when the output is read
(``check/snapshot.py``). The compiled cached scan reads them as they are
(the ``CachedScan`` of ``runner/step/fast/``; it declines anything but C-contiguous ``int32``
arrays of the documented shapes and consistent counts). Every other step goes
through :func:`unpack_into`: the counts are checked against each other and the arrays
become vLLM's form in the :class:`~attnplug.runner.step.check.snapshot.Deltas`, so that the
vectorized checks plan both forms alike; :func:`renamed` then rewords an error they raise
about a packed value with the packed field's name (the drafts stay arrays:
``check/spec.py``).
"""

from __future__ import annotations

import numpy as np

from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.check.types import err, show
from attnplug.runner.step.packed_deltas import unpack_cached_deltas
from attnplug.runner.step.scheduler_output import PackedCachedDeltas

FIELD = "packed_cached"
_ARRAYS = (("num_draft_tokens", 1), ("draft_token_ids", 1), ("num_new_blocks", 2), ("new_block_ids", 1))


def read_packed(pk, spec: dict) -> tuple | None:
    """``SchedulerOutput.packed_cached`` read once: its four fields as a tuple
    ``(num_draft_tokens, draft_token_ids, num_new_blocks, new_block_ids)`` (the caller's
    arrays; their containers are checked by the compiled scan, which declines anything
    else, and in words by :func:`unpack_into`); ``None`` stays ``None``.

    Raises:
        InvalidSchedulerOutput: not a ``PackedCachedDeltas``; drafts in
            ``scheduled_spec_decode_tokens`` too.
    """
    if pk is None:
        return None
    if type(pk) is not PackedCachedDeltas and not isinstance(pk, PackedCachedDeltas):
        err(None, FIELD, f"expected PackedCachedDeltas or None, got {type(pk).__name__}")
    if spec:
        err(None, "scheduled_spec_decode_tokens", f"must be empty when {FIELD} carries the drafts, "
            f"got {len(spec)} entries")
    return pk.num_draft_tokens, pk.draft_token_ids, pk.num_new_blocks, pk.new_block_ids


def _check_arrays(packed: tuple, num_cached: int) -> PackedCachedDeltas:
    """The containers of :func:`read_packed`'s tuple: C-contiguous ``int32`` arrays of
    their ranks, count arrays with one entry (column) per cached request."""
    for (name, ndim), a in zip(_ARRAYS, packed):
        if type(a) is not np.ndarray or a.dtype != np.int32 or a.ndim != ndim or not a.flags.c_contiguous:
            err(None, f"{FIELD}.{name}", f"expected a C-contiguous {ndim}-D int32 array, got "
                + (f"{a.ndim}-D {a.dtype}" + ("" if a.flags.c_contiguous else " (not contiguous)")
                   if isinstance(a, np.ndarray) else show(a)))
    if packed[0].shape[0] != num_cached:
        err(None, f"{FIELD}.num_draft_tokens", f"has {packed[0].shape[0]} entries for {num_cached} cached requests")
    if packed[2].shape[1] != num_cached:
        err(None, f"{FIELD}.num_new_blocks", f"has {packed[2].shape[1]} columns for {num_cached} cached requests")
    return PackedCachedDeltas(*packed)


def unpack_into(d, num_groups: int) -> set:
    """Check the packed arrays of ``d`` (a ``Deltas`` with ``packed``) and put its appends
    into ``d`` in vLLM's form (new containers: the caller's are not changed); its drafts
    go to ``d.spec_packed`` (``check/spec.py`` checks them as arrays, and turns them into
    vLLM's dict only to word an error).

    Returns:
        The ids of the requests whose appends came packed (for :func:`renamed`).

    Raises:
        InvalidSchedulerOutput: a field that is not a C-contiguous ``int32`` array of its
            rank, count arrays whose length is not the number of cached requests,
            ``num_new_blocks`` without ``G`` rows, a negative count,
            counts that do not sum to the ids' length, appends in ``new_block_ids`` of a
            request that is not resumed, packed appends of a resumed one.
    """
    cached = d.scheduled_cached_reqs
    C = cached.req_ids
    pk = _check_arrays(d.packed, len(C))
    nd, nb = pk.num_draft_tokens, pk.num_new_blocks
    if nb.shape[0] != num_groups:
        err(None, f"{FIELD}.num_new_blocks", f"has {nb.shape[0]} rows for {num_groups} cache groups")
    for name, counts, ids in (("num_draft_tokens", nd, pk.draft_token_ids), ("num_new_blocks", nb, pk.new_block_ids)):
        if counts.size and counts.min() < 0:
            i = int(np.flatnonzero((counts < 0).any(axis=0) if counts.ndim == 2 else counts < 0)[0])
            err(C[i], f"{FIELD}.{name}", "counts must be >= 0")
        if int(counts.sum(dtype=np.int64)) != ids.shape[0]:
            err(None, f"{FIELD}.{name}", f"counts sum to {int(counts.sum(dtype=np.int64))}, but "
                f"{FIELD}.{'draft_token_ids' if name == 'num_draft_tokens' else 'new_block_ids'} holds {ids.shape[0]}")
    appending = nb.any(axis=0) if num_groups else np.zeros(len(C), bool)
    nbl, res = cached.new_block_ids, cached.resumed_from_preemption
    # every entry None and nobody resumed (list.count / in: no Python loop): nothing to check
    try:
        each = nbl.count(None) != len(C) or True in res
    except (TypeError, ValueError):  # an entry whose == raises (an array): look at each
        each = True
    for i, (e, resumed) in enumerate(zip(nbl, res) if each else ()):
        if resumed is True or (isinstance(resumed, np.bool_) and resumed):
            if appending[i]:
                err(C[i], f"{FIELD}.num_new_blocks", "a resumed request's blocks replace its own: send them in "
                    "scheduled_cached_reqs.new_block_ids, with 0 here")
        elif e is not None:
            err(C[i], "new_block_ids", f"must be None when {FIELD} carries the appends, got {show(e)}")
    no_drafts = PackedCachedDeltas(np.zeros(0, np.int32), pk.draft_token_ids[:0], nb, pk.new_block_ids)
    _, new_block_ids = unpack_cached_deltas(C, cached.new_block_ids, no_drafts)
    d.spec_decode_tokens = {}
    d.spec_packed = (nd, pk.draft_token_ids)  # check/spec.py checks them as arrays
    d.scheduled_cached_reqs = cached.with_block_ids(new_block_ids)
    d.packed = None
    return {C[i] for i in np.flatnonzero(appending).tolist()}


def renamed(e: InvalidSchedulerOutput, packed_appends: set) -> InvalidSchedulerOutput:
    """``e`` with the packed field's name when it is about a packed value (drafts, or the
    appends of a request in ``packed_appends``); else ``e``."""
    if e.field == "scheduled_spec_decode_tokens":
        name = "draft_token_ids"
    elif e.field == "new_block_ids" and e.req_id in packed_appends:
        name = "new_block_ids"
    else:
        return e
    msg = str(e).split(f"{e.field}: ", 1)[-1]
    return InvalidSchedulerOutput(e.req_id, f"{FIELD}.{name}", msg)
