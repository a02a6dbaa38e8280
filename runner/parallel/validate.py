"""``ATTNPLUG_VALIDATE=1`` across ranks: every step, each rank hashes every field of the
``CommonAttentionMetadata`` it built, the hashes are all-gathered, and any difference is a
:class:`RankMismatchError` naming the step, the ranks and the fields (on every rank, so
all of them stop together).

A rank that built different metadata would still run (its collectives only need equal
shapes) and silently compute wrong attention: the check makes "every rank rebuilds the
same step from the same deltas" an asserted fact, not an assumption.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.parallel.state import ParallelState


class RankMismatchError(MetadataError):
    """Ranks built different metadata for the same step."""


def field_digests(common: CommonAttentionMetadata) -> dict[str, str]:
    """``{field: sha256 hex[:16]}`` of every field (a tensor: dtype, shape and bytes, read on
    the host; so this synchronises with a GPU, which is why it is a debug mode)."""
    out = {}
    for f in dataclasses.fields(common):
        v = getattr(common, f.name)
        h = hashlib.sha256()
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())
        out[f.name] = h.hexdigest()[:16]
    return out


class MetadataIdentityCheck:
    """Called with each step's common metadata of every cache group (``ModelRunner.on_common_metadata``);
    all-gathers :func:`field_digests` on ``state.cpu_group`` and compares with rank 0's.

    Raises:
        RankMismatchError: ``step N: CommonAttentionMetadata differs from rank 0's on rank(s)
            [..] in field(s) [..]``.
    """

    def __init__(self, state: ParallelState):
        self.state = state
        self.step = 0

    def __call__(self, per_group: list[CommonAttentionMetadata]) -> None:
        """``per_group``: the step's metadata of each cache group (``StepInputs.common_attn_metadata``);
        fields are named ``<field>`` for group 0 and ``<field>@g<i>`` for group ``i > 0``."""
        mine = {}
        for g, common in enumerate(per_group):
            mine.update({(k if g == 0 else f"{k}@g{g}"): v for k, v in field_digests(common).items()})
        every: list = [None] * self.state.world_size
        dist.all_gather_object(every, mine, group=self.state.cpu_group)
        ref = every[0]
        bad = {r: sorted(k for k in ref if d.get(k) != ref[k]) for r, d in enumerate(every) if d != ref}
        step, self.step = self.step, self.step + 1
        if bad:
            fields = sorted({k for ks in bad.values() for k in ks})
            raise RankMismatchError(
                f"step {step}: CommonAttentionMetadata differs from rank 0's on rank(s) {sorted(bad)} in "
                f"field(s) {fields}: every rank must build the same step from the same SchedulerOutput")
