"""``CommonAttentionMetadata``: the backend-agnostic facts of one step.

The runner builds exactly one of these per step (for cache group 0); every other
cache group gets a :meth:`CommonAttentionMetadata.replace` copy that swaps in its own
``block_table_tensor`` and ``slot_mapping``. Builders lower it into what their kernel
needs and must never mutate it.

Names follow vLLM V1's ``CommonAttentionMetadata`` so ported backends map one to one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attnplug.core.devices import resolve_device


@dataclass
class CommonAttentionMetadata:
    """Per-step attention facts shared by every backend.

    Rows are the scheduled requests in batch order (``num_reqs`` of them); tokens are the
    flat stream of their scheduled tokens, request after request. Tensors may be longer
    than the real counts when the step is padded (CUDA graphs): then ``num_actual_tokens``
    and ``num_reqs`` give the real sizes, padded tokens carry ``PAD_SLOT_ID`` in
    ``slot_mapping`` and padded requests have empty queries.

    Examples:
        >>> import torch
        >>> m = CommonAttentionMetadata.from_lengths(
        ...     num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3],
        ...     block_table=[[1, 2], [5, 0]], block_size=4)
        >>> m.query_start_loc.tolist(), m.seq_lens.tolist(), m.slot_mapping.tolist()
        ([0, 1, 4], [6, 3], [9, 20, 21, 22])
    """

    query_start_loc: torch.Tensor
    """``[num_reqs + 1]``, ``torch.int32``, on the compute device; units: tokens. Exclusive
    prefix sum of the per-request query lengths: request i's queries are tokens
    ``query_start_loc[i] : query_start_loc[i+1]`` of the flat stream. ``[0] == 0``."""

    query_start_loc_cpu: torch.Tensor
    """``[num_reqs + 1]``, ``torch.int32``, CPU. Host copy of ``query_start_loc``."""

    seq_lens: torch.Tensor
    """``[num_reqs]``, ``torch.int32``, on the compute device; units: tokens. Length of each
    request's KV after this step: ``num_computed_tokens + num_scheduled_tokens``."""

    seq_lens_cpu: torch.Tensor
    """``[num_reqs]``, ``torch.int32``, CPU. Host copy of ``seq_lens``."""

    num_computed_tokens_cpu: torch.Tensor
    """``[num_reqs]``, ``torch.int32``, CPU; units: tokens. KV tokens already in the cache
    before this step (the context length c_i; query j of request i sits at position c_i + j)."""

    num_reqs: int
    """Number of real (non-padded) requests."""

    num_actual_tokens: int
    """Number of real (non-padded) scheduled tokens, ``== query_start_loc_cpu[num_reqs]``."""

    max_query_len: int
    """Largest per-request query length this step (tokens)."""

    max_seq_len: int
    """Largest ``seq_lens`` entry this step (tokens)."""

    block_table_tensor: torch.Tensor
    """``[num_reqs, max_num_blocks_per_req]``, ``torch.int32``, on the compute device; units:
    kernel block ids. Row i lists request i's physical blocks in logical order (in the
    *kernel* block size of this group: a manager block b of ``k`` kernel blocks becomes
    ``b*k .. b*k+k-1``). Entries past the request's blocks hold ``NULL_BLOCK_ID``."""

    slot_mapping: torch.Tensor
    """``[num_tokens]``, ``torch.int64``, on the compute device; units: flat slot index
    ``block_id * block_size + offset``. Where token t's K/V is written. ``PAD_SLOT_ID`` (-1)
    marks padded tokens, which no kernel writes."""

    causal: bool = True
    """Causal attention with bottom-right alignment: query j of request i sees keys
    ``0 .. num_computed_tokens[i] + j`` (inclusive)."""

    positions: torch.Tensor | None = None
    """``[num_tokens]``, ``torch.int64``, on the compute device; units: token positions
    within each request (``num_computed_tokens[req] + offset``). Used by RoPE."""

    is_prefilling: torch.Tensor | None = None
    """``[num_reqs]``, ``torch.bool``, CPU. True while the request has not yet computed its
    whole prompt before this step (``num_computed_tokens < num_prompt_tokens``); tells a
    one-token prefill chunk from a real decode."""

    num_draft_tokens_cpu: torch.Tensor | None = None
    """``[num_reqs]``, ``torch.int32``, CPU; units: tokens. Speculative decoding: the draft
    tokens at the end of each row's query (a verifying row has query length ``1 + d``:
    its last real token, then ``d`` drafts; 0 for every other row). ``None`` in a step
    without drafts. State backends write the state after each of a verifying row's
    positions to its scratch slots (docs/speculative-decoding.md, "State groups")."""

    def replace(self, **changes) -> "CommonAttentionMetadata":
        """Return a shallow copy with ``changes`` applied (per-group block table / slot mapping).

        Tensors that are not replaced are shared, not copied. The class has no
        ``__post_init__``, so the copy is the instance's fields with ``changes`` written over
        them; a subclass (which may run its own) and an instance given attributes besides its
        fields (which the copy must not carry) go through ``dataclasses.replace``.

        Raises:
            TypeError: a name that is not a field.
        """
        if type(self) is not CommonAttentionMetadata:
            return dataclasses.replace(self, **changes)
        if not _FIELD_NAMES.issuperset(changes):
            unknown = sorted(changes.keys() - _FIELD_NAMES)
            raise TypeError(f"CommonAttentionMetadata.replace: no field named {unknown[0]!r}")
        own = self.__dict__
        if len(own) != len(_FIELD_NAMES):  # an attribute set on the instance besides the fields
            return dataclasses.replace(self, **changes)  # (which leaves it behind)
        new = object.__new__(CommonAttentionMetadata)
        fields = new.__dict__
        fields.update(own)
        fields.update(changes)
        return new

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """``[num_reqs]``, ``torch.int32``, CPU: per-request query lengths (tokens)."""
        qsl = self.query_start_loc_cpu[: self.num_reqs + 1]
        return qsl[1:] - qsl[:-1]

    @classmethod
    def from_lengths(
        cls,
        num_computed_tokens,
        num_scheduled_tokens,
        block_table,
        block_size: int,
        device: torch.device | str = "cpu",
        num_prompt_tokens=None,
    ) -> "CommonAttentionMetadata":
        """Build metadata directly from per-request lengths and a block table.

        A convenience for tests, examples and plugin authors; the runner builds its
        metadata from its persistent buffers instead (``attnplug.runner``).

        Args:
            num_computed_tokens: ``[num_reqs]`` ints, tokens already cached per request.
            num_scheduled_tokens: ``[num_reqs]`` ints (>= 0), query length per request.
            block_table: ``[num_reqs][max_num_blocks_per_req]`` ints, physical block ids in
                this group's block size.
            block_size: tokens per block.
            device: where the device tensors go.
            num_prompt_tokens: optional ``[num_reqs]`` prompt lengths for ``is_prefilling``
                (default: every row with a query longer than one token is prefilling).

        Raises:
            MetadataError: mismatched lengths, or a block table too short for ``seq_lens``.
        """
        from attnplug.core.errors import MetadataError

        computed = torch.as_tensor(num_computed_tokens, dtype=torch.int64)
        sched = torch.as_tensor(num_scheduled_tokens, dtype=torch.int64)
        bt = torch.as_tensor(block_table, dtype=torch.int64)
        if bt.dim() == 1:
            bt = bt.reshape(len(computed), -1)
        if computed.shape != sched.shape or bt.shape[0] != computed.shape[0]:
            raise MetadataError(
                f"num_computed_tokens {tuple(computed.shape)}, num_scheduled_tokens "
                f"{tuple(sched.shape)} and block_table rows {bt.shape[0]} must agree: one entry per request"
            )
        seq_lens = computed + sched
        if (seq_lens > bt.shape[1] * block_size).any():
            raise MetadataError(
                f"block_table has {bt.shape[1]} blocks of {block_size} per row but seq_lens max is "
                f"{int(seq_lens.max())}: give each request enough blocks"
            )
        qsl = torch.zeros(len(sched) + 1, dtype=torch.int64)
        qsl[1:] = torch.cumsum(sched, 0)
        req_idx = torch.repeat_interleave(torch.arange(len(sched)), sched)
        positions = computed[req_idx] + torch.arange(int(qsl[-1])) - qsl[:-1][req_idx]
        slots = bt[req_idx, positions // block_size] * block_size + positions % block_size
        if num_prompt_tokens is None:
            is_prefilling = sched > 1
        else:
            is_prefilling = computed < torch.as_tensor(num_prompt_tokens, dtype=torch.int64)
        dev = resolve_device(device)
        return cls(
            query_start_loc=qsl.to(torch.int32).to(dev),
            query_start_loc_cpu=qsl.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32).to(dev),
            seq_lens_cpu=seq_lens.to(torch.int32),
            num_computed_tokens_cpu=computed.to(torch.int32),
            num_reqs=len(sched),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(sched.max()) if len(sched) else 0,
            max_seq_len=int(seq_lens.max()) if len(sched) else 0,
            block_table_tensor=bt.to(torch.int32).to(dev),
            slot_mapping=slots.to(torch.int64).to(dev),
            causal=True,
            positions=positions.to(dev),
            is_prefilling=is_prefilling,
        )


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(CommonAttentionMetadata))
"""The field names ``CommonAttentionMetadata.replace`` accepts."""
