"""Stage 1, first: read the scheduler output once, check its containers, keep what was read.

Every later check (and stage 2) works on the :class:`Deltas` this returns, never on the
caller's objects again: a field is read exactly once, so an object whose attributes
change between reads (a property, a caller mutating it from another thread) cannot be
validated as one thing and applied as another. The lists inside are the caller's (read,
not copied: copying every prompt would double the cost of a step); stage 1 converts
their contents into the runner's own arrays, and nothing keeps a reference to them after
``update_states`` returns.

The typing rule (the same on the compiled and the numpy path; see
``runner/step/scheduler_output.py``): containers are the documented types — ``list`` or
``tuple`` for sequences, ``dict`` for ``num_scheduled_tokens``, a ``set``, ``frozenset``,
``list`` or ``tuple`` of ids for ``finished_req_ids``; ids are ``str`` or a ``str`` subclass
such as ``numpy.str_`` (:func:`~attnplug.runner.step.check.types.request_id`); integer fields are
``int`` or numpy integer scalars (never ``bool``), integer lists are lists/tuples of those
or 1-D numpy integer arrays; flags are ``bool`` (or ``numpy.bool_``).
"""

from __future__ import annotations

from typing import Any

from attnplug.runner.step.check.packed import read_packed
from attnplug.runner.step.check.types import ID_SETS, SEQUENCES, err, is_int_list, request_id, show
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

class NewReq:
    """One ``NewRequestData``, each field read once (same attribute names)."""

    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "block_ids", "num_computed_tokens",
                 "sampling_params", "prompt_embeds", "mm_placeholders", "mm_features")

    def __init__(self, nr: NewRequestData):
        if type(nr) is not NewRequestData and not isinstance(nr, NewRequestData):
            err(None, "scheduled_new_reqs", f"entries must be NewRequestData, got {type(nr).__name__}")
        rid = nr.req_id
        if type(rid) is not str:
            rid = request_id(rid, "scheduled_new_reqs")
        self.req_id = rid
        prompt = self.prompt_token_ids = nr.prompt_token_ids
        if type(prompt) is not list and not is_int_list(prompt):  # lists: the common case, first
            err(rid, "prompt_token_ids", f"expected a list of token ids (or a 1-D integer array), got {show(prompt)}")
        outs = self.output_token_ids = nr.output_token_ids
        if type(outs) is not list and not is_int_list(outs):
            err(rid, "output_token_ids", f"expected a list of token ids (or a 1-D integer array), got {show(outs)}")
        self.block_ids = nr.block_ids
        self.num_computed_tokens = nr.num_computed_tokens
        self.sampling_params = nr.sampling_params
        self.prompt_embeds = nr.prompt_embeds  # checked in check.py (runner/step/prompt_embeds.py)
        self.mm_placeholders = nr.mm_placeholders  # checked in check.py (runner/step/mrope.py)
        self.mm_features = nr.mm_features  # checked in check.py (runner/step/multimodal.py)


class CachedDeltas:
    """``CachedRequestData``'s five lists, each read once (same attribute names)."""

    __slots__ = ("req_ids", "resumed_from_preemption", "new_token_ids", "new_block_ids", "num_computed_tokens")

    def __init__(self, cached: CachedRequestData):
        if not isinstance(cached, CachedRequestData):
            err(None, "scheduled_cached_reqs", f"expected CachedRequestData, got {type(cached).__name__}")
        for name in self.__slots__:
            v = getattr(cached, name)
            if not isinstance(v, SEQUENCES):
                err(None, f"scheduled_cached_reqs.{name}", f"expected a list, got {show(v)}")
            setattr(self, name, v)
        n = len(self.req_ids)
        for name in self.__slots__[1:]:
            if len(getattr(self, name)) != n:
                err(None, f"scheduled_cached_reqs.{name}", f"has {len(getattr(self, name))} entries for "
                    f"{n} req_ids: every list needs one entry per cached request")

    def with_block_ids(self, new_block_ids: list) -> "CachedDeltas":
        """A copy whose ``new_block_ids`` is ``new_block_ids`` (the other lists shared)."""
        out = object.__new__(CachedDeltas)
        for name in self.__slots__:
            setattr(out, name, getattr(self, name))
        out.new_block_ids = new_block_ids
        return out


class Deltas:
    """A ``SchedulerOutput``, each field read once (same attribute names), containers checked.

    Raises:
        InvalidSchedulerOutput: a field of the wrong container type, a new request that is
            not ``NewRequestData`` or whose ``req_id`` is not a ``str`` (a subclass is kept as
            the plain ``str`` of the same value), token lists that are
            not lists or 1-D integer arrays, lists of ``scheduled_cached_reqs`` of unequal
            length, unhashable finished ids, a ``packed_cached`` that is not a
            ``PackedCachedDeltas`` (its arrays: ``check/packed.py``).
    """

    __slots__ = ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                 "total_num_scheduled_tokens", "finished_req_ids", "spec_decode_tokens", "packed", "spec_packed")

    def __init__(self, so: SchedulerOutput):
        if not isinstance(so, SchedulerOutput):
            err(None, "scheduler_output", f"expected SchedulerOutput, got {type(so).__name__}")
        new = so.scheduled_new_reqs
        if not isinstance(new, SEQUENCES):
            err(None, "scheduled_new_reqs", f"expected a list of NewRequestData, got {show(new)}")
        self.scheduled_new_reqs = [NewReq(nr) for nr in new]
        self.scheduled_cached_reqs = CachedDeltas(so.scheduled_cached_reqs)
        nst = self.num_scheduled_tokens = so.num_scheduled_tokens
        if type(nst) is not dict:
            err(None, "num_scheduled_tokens", f"expected a dict {{req_id: int}}, got {type(nst).__name__}")
        self.total_num_scheduled_tokens = so.total_num_scheduled_tokens  # checked with the counts
        spec = self.spec_decode_tokens = so.scheduled_spec_decode_tokens  # checked in check/spec.py
        if type(spec) is not dict:
            err(None, "scheduled_spec_decode_tokens", f"expected a dict {{req_id: [draft token ids]}}, "
                f"got {show(spec)}")
        # the packed drafts and appends (check/packed.py): containers here, counts when unpacked
        self.packed = read_packed(so.packed_cached, spec)
        self.spec_packed = None  # (num_draft_tokens, draft_token_ids) once check/packed.py unpacked
        fin = so.finished_req_ids
        if not isinstance(fin, ID_SETS):
            err(None, "finished_req_ids", f"expected a set of request ids, got {show(fin)}")
        try:
            self.finished_req_ids = list(dict.fromkeys(fin))
        except TypeError:
            bad = next(r for r in fin if not _hashable(r))
            err(None, "finished_req_ids", f"request ids must be str, got {show(bad)}")


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True
