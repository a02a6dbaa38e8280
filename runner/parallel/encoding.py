"""Two ways to broadcast a ``SchedulerOutput`` from rank 0, measured against each other
(``attnplug bench``-style numbers in docs/distributed.md and docs/performance.md):

* ``"object"``: ``torch.distributed.broadcast_object_list`` (pickle; two broadcasts: the
  size, then the bytes);
* ``"fixed"``: :class:`FixedBroadcast`: pickle into a preallocated ``uint8`` buffer of
  :data:`FIXED_CAPACITY` bytes behind an 8-byte length: *one* broadcast per step while
  the output fits (a second, exact-size one when it does not);
* ``"tensor"``: :func:`encode` packs every field into one ``int64`` stream plus one UTF-8
  blob of the request ids (floats as their IEEE-754 bits), sent as one ``uint8`` tensor
  after its two lengths (also two broadcasts); :func:`decode` rebuilds the same output.

All run on the host group (``ParallelState.cpu_group``, gloo). The tensor form knows
the fields of ``SchedulerOutput`` one by one: a field it does not know must hold its
default (the receiver rebuilds the default), else :class:`EncodingError` — never silently
dropped.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import torch
import torch.distributed as dist

from attnplug.core.errors import AttnplugError
from attnplug.runner.step.packed_deltas import as_vllm_form
from attnplug.runner.step.scheduler_output import (CachedRequestData, NewRequestData, SamplingParams,
                                                   SchedulerOutput)

KNOWN_FIELDS = {
    SchedulerOutput: ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                      "total_num_scheduled_tokens", "finished_req_ids"),
    NewRequestData: ("req_id", "prompt_token_ids", "block_ids", "num_computed_tokens", "sampling_params",
                     "output_token_ids"),
    CachedRequestData: ("req_ids", "resumed_from_preemption", "new_token_ids", "new_block_ids",
                        "num_computed_tokens"),
    SamplingParams: ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop_token_ids"),
}


class EncodingError(AttnplugError):
    """A ``SchedulerOutput`` the tensor encoding does not know how to carry."""


def _extra_fields(cls) -> tuple:
    """The fields of ``cls`` the encoding does not carry: ``((name, default), ...)``."""
    known = KNOWN_FIELDS.get(cls)
    if known is None:
        raise EncodingError(f"a {cls.__name__}: the tensor encoding does not know it; use the 'fixed' broadcast")
    out = []
    for f in dataclasses.fields(cls):
        if f.name not in known:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out.append((f.name, default))
    return tuple(out)


def _check_defaults(obj) -> None:
    """A field the encoding does not carry must hold its default (the receiver gets the default)."""
    for name, default in _EXTRA.setdefault(type(obj), _extra_fields(type(obj))):
        if getattr(obj, name) != default:
            raise EncodingError(f"{type(obj).__name__}.{name} is set, and the tensor encoding carries only "
                                f"{KNOWN_FIELDS[type(obj)]}: use the 'fixed' broadcast (the default)")


_EXTRA: dict[type, tuple] = {}


def _f2i(x: float) -> int:
    return int(np.float64(x).view(np.int64))


class _Writer:
    def __init__(self):
        self.ints: list[int] = []
        self.blob = bytearray()

    def list(self, xs) -> None:
        self.ints.append(len(xs))
        self.ints.extend(xs)

    def str(self, s: str) -> None:
        b = s.encode()
        self.ints.append(len(b))
        self.blob += b

    def groups(self, block_ids) -> None:
        self.ints.append(len(block_ids))
        for ids in block_ids:
            self.list(ids)


def encode(out: SchedulerOutput) -> bytes:
    """The compact form: ``len(ints)`` and ``len(blob)`` as 16 bytes, the int64 stream, the blob
    (packed drafts and appends, ``PackedCachedDeltas``, are sent in vLLM's form)."""
    out = as_vllm_form(out)
    _check_defaults(out)
    _check_defaults(out.scheduled_cached_reqs)
    w = _Writer()
    w.ints.append(len(out.scheduled_new_reqs))
    for r in out.scheduled_new_reqs:
        sp = r.sampling_params
        _check_defaults(r)
        _check_defaults(sp)
        w.str(r.req_id)
        w.list(r.prompt_token_ids)
        w.groups(r.block_ids)
        w.ints += [r.num_computed_tokens, _f2i(sp.temperature), sp.top_k, _f2i(sp.top_p),
                   sp.seed is not None, sp.seed or 0, sp.max_tokens]
        w.list(sp.stop_token_ids)
        w.list(r.output_token_ids)
    c = out.scheduled_cached_reqs
    w.ints.append(len(c.req_ids))
    for i, rid in enumerate(c.req_ids):
        w.str(rid)
        w.ints.append(bool(c.resumed_from_preemption[i]))
        w.list(c.new_token_ids[i])
        blocks = c.new_block_ids[i]
        w.ints.append(blocks is not None)
        if blocks is not None:
            w.groups(blocks)
        w.ints.append(c.num_computed_tokens[i])
    w.ints.append(len(out.num_scheduled_tokens))
    for rid, n in out.num_scheduled_tokens.items():
        w.str(rid)
        w.ints.append(n)
    w.ints.append(out.total_num_scheduled_tokens)
    w.ints.append(len(out.finished_req_ids))
    for rid in out.finished_req_ids:
        w.str(rid)
    ints = np.asarray(w.ints, dtype=np.int64)
    return np.asarray([ints.size, len(w.blob)], dtype=np.int64).tobytes() + ints.tobytes() + bytes(w.blob)


class _Reader:
    def __init__(self, ints: list[int], blob: bytes):
        self.ints, self.blob, self.i, self.b = ints, blob, 0, 0

    def int(self) -> int:
        self.i += 1
        return self.ints[self.i - 1]

    def list(self) -> list[int]:
        n = self.int()
        self.i += n
        return self.ints[self.i - n:self.i]

    def str(self) -> str:
        n = self.int()
        self.b += n
        return self.blob[self.b - n:self.b].decode()

    def groups(self) -> tuple[list[int], ...]:
        return tuple(self.list() for _ in range(self.int()))

    def float(self) -> float:
        return float(np.int64(self.int()).view(np.float64))


def decode(data: bytes) -> SchedulerOutput:
    """Inverse of :func:`encode`."""
    n_ints, _ = np.frombuffer(data[:16], dtype=np.int64).tolist()
    ints = np.frombuffer(data[16:16 + 8 * n_ints], dtype=np.int64).tolist()
    r = _Reader(ints, data[16 + 8 * n_ints:])
    new = []
    for _ in range(r.int()):
        rid, prompt, blocks, computed = r.str(), r.list(), r.groups(), r.int()
        temp, top_k, top_p, has_seed, seed, max_tokens = r.float(), r.int(), r.float(), r.int(), r.int(), r.int()
        sp = SamplingParams(temp, top_k, top_p, seed if has_seed else None, max_tokens, tuple(r.list()))
        new.append(NewRequestData(rid, prompt, blocks, computed, sp, r.list()))
    cached = CachedRequestData()
    for _ in range(r.int()):
        cached.req_ids.append(r.str())
        cached.resumed_from_preemption.append(bool(r.int()))
        cached.new_token_ids.append(r.list())
        cached.new_block_ids.append(r.groups() if r.int() else None)
        cached.num_computed_tokens.append(r.int())
    sched = {r.str(): r.int() for _ in range(r.int())}
    total = r.int()
    finished = {r.str() for _ in range(r.int())}
    return SchedulerOutput(new, cached, sched, total, finished)


def broadcast_tensor(out: SchedulerOutput | None, group, src: int = 0) -> SchedulerOutput:
    """Broadcast ``out`` (given on ``src``, ``None`` elsewhere) in the compact form."""
    is_src = dist.get_rank() == src
    payload = encode(out) if is_src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_src
           else torch.empty(int(size), dtype=torch.uint8))
    dist.broadcast(buf, src, group=group)
    return out if is_src else decode(buf.numpy().tobytes())


def broadcast_object(obj, group, src: int = 0):
    """Broadcast any picklable ``obj`` (given on ``src``) with ``broadcast_object_list``."""
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src, group=group)
    return box[0]


FIXED_CAPACITY = 1 << 16
"""Bytes of :class:`FixedBroadcast`'s buffer (a real step of ``attnplug run``'s trace
pickles to well under 1 KiB; 48 new 1000-token prompts are about 200 KiB and take the
second broadcast)."""


class FixedBroadcast:
    """Broadcast a picklable object in one collective when it fits ``capacity`` bytes.

    The buffer's first 8 bytes carry the pickle's length ``n``; if ``n <= capacity - 8``
    the pickle follows in the same buffer, else the receivers allocate ``n`` bytes and a
    second broadcast carries it. Every rank holds one buffer for the whole run.
    """

    def __init__(self, capacity: int = FIXED_CAPACITY):
        self.buf = torch.zeros(capacity, dtype=torch.uint8)

    def __call__(self, obj, group, src: int = 0):
        room = self.buf.numel() - 8
        if dist.get_rank() == src:
            data = pickle.dumps(obj)
            self.buf[:8] = torch.frombuffer(bytearray(np.int64(len(data)).tobytes()), dtype=torch.uint8)
            if len(data) <= room:
                self.buf[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.broadcast(self.buf, src, group=group)
            if len(data) > room:
                dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src, group=group)
            return obj
        dist.broadcast(self.buf, src, group=group)
        n = int(self.buf[:8].view(torch.int64))
        if n <= room:
            return pickle.loads(self.buf[8:8 + n].numpy().tobytes())
        extra = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(extra, src, group=group)
        return pickle.loads(extra.numpy().tobytes())
