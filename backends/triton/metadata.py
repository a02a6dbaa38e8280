"""``TritonAttentionMetadata`` and the split-KV decision.

The metadata is what every ``triton`` layer of a cache group reads in one step; its
tensors are the step's own views (eager builds) or views of the builder's persistent
buffers (CUDA-graph builds), see ``builder.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnplug.backends.common.sealed import sealed


@dataclass(frozen=True)
class TritonCascadeMetadata:
    """The two passes of a cascade step (``backends/triton/cascade.py``), device tensors.

    The prefix pass is ONE non-causal "request" whose queries are all the step's tokens
    and whose keys are the shared prefix; the suffix pass is the step itself with every
    request's first ``common_prefix_len`` tokens cut off (causality is relative to the end
    of a request, so its masks are those of the full step).
    """

    common_prefix_len: int
    """``P`` tokens: a multiple of ``block_size``, ``<=`` every ``num_computed_tokens``."""
    prefix_query_start_loc: torch.Tensor
    """``[2]``, ``torch.int32``: ``[0, num_actual_tokens]``."""
    prefix_seq_lens: torch.Tensor
    """``[1]``, ``torch.int32``: ``[P]``."""
    prefix_block_table: torch.Tensor
    """``[1, P // block_size]``, ``torch.int32``: row 0's first blocks (the same in every row)."""
    suffix_seq_lens: torch.Tensor
    """``[num_reqs]``, ``torch.int32``: ``seq_lens - P``."""
    suffix_block_table: torch.Tensor
    """``[num_reqs, >= cdiv(max_seq_len - P, block_size)]``, ``torch.int32``: the block table
    from column ``P // block_size`` on (a view)."""


@sealed
@dataclass(slots=True)
class TritonAttentionMetadata:
    """One step of one cache group, lowered for the Triton kernels.

    Sealed (``backends/common/sealed.py``): every layer of the group reads the same object,
    so assigning a field raises ``dataclasses.FrozenInstanceError``, as on a frozen dataclass.

    Every tensor lives on the compute device. An eager build passes the step's tensors
    through (views of the step compiler's persistent buffers when the runner built them:
    valid until its next ``update_states``); a CUDA-graph build (``graph``) copies them into
    the builder's persistent buffers, at the same addresses every step (graphs replay
    them), valid until that builder's next graph build or ``update_block_table``.
    """

    num_reqs: int
    """Requests the kernels walk: the real ones in an eager build; in a CUDA-graph build
    (``build_for_cudagraph_capture``) the padded count the graph was captured with, the
    padding requests having empty queries (``query_start_loc`` repeats its last value)."""
    num_actual_tokens: int
    """Real (non-padded) tokens; query rows past it are padding and never written."""
    max_query_len: int
    """Longest query this step (tokens); picks the kernel's tile sizes."""
    max_seq_len: int
    """Longest ``seq_len`` this step (tokens)."""
    block_size: int
    """Tokens per kernel block; equals ``kv_cache.shape[2]``."""
    causal: bool
    """Bottom-right aligned causal attention (query ``j`` of request ``i`` sees keys up to
    position ``seq_lens[i] - query_len_i + j``)."""
    query_start_loc: torch.Tensor
    """``[num_reqs + 1]``, ``torch.int32``; tokens. Exclusive prefix sum of query lengths."""
    seq_lens: torch.Tensor
    """``[num_reqs]``, ``torch.int32``; tokens of KV per request after this step."""
    block_table_tensor: torch.Tensor
    """``[>= num_reqs, >= cdiv(max_seq_len, block_size)]``, ``torch.int32``; kernel block ids
    in logical order; columns past each request's ``cdiv(seq_len, block_size)`` are never
    read (``NULL_BLOCK_ID``, or in a graph build whatever an earlier step left there)."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` (padded length), ``torch.int64``; flat slot of each token's K/V,
    ``PAD_SLOT_ID`` for padded tokens (not written)."""
    num_kv_splits: int
    """1: the unified kernel in one launch. ``> 1`` (a power of two): the split-KV path,
    every request's visible keys in ``num_kv_splits`` segments, then a reduce."""
    graph: bool = False
    """Built by ``build_for_cudagraph_capture``: every tensor is in the builder's persistent
    buffers (``update_block_table`` then copies the other group's tensors there too)."""

    cascade: TritonCascadeMetadata | None = None
    """Set when the builder got ``common_prefix_len > 0`` (eager builds of full-attention
    groups only): ``forward`` then runs the prefix pass, the suffix pass and the merge. The
    other fields stay those of the whole step (the K/V write uses them)."""

    @property
    def use_split_kv(self) -> bool:
        """Whether ``forward`` takes the split-KV path (segments + reduce)."""
        return self.num_kv_splits > 1


@dataclass(frozen=True)
class SplitKVPolicy:
    """When the builder picks the split-KV path, and how many segments.

    A decode step gives one program per (request, KV head); with few requests that
    leaves most of a GPU idle while each program walks a long context. Splitting every
    request's keys into segments multiplies the programs; a reduce combines them.

    Attributes:
        max_query_len: split only when no query is longer (decode-heavy batches).
        min_seq_len: ... and the longest context has at least this many tokens.
        min_tokens_per_split: segments of the longest context hold at least this many keys.
        max_splits: upper bound (a power of two).
        programs_per_sm: aim for this many programs per streaming multiprocessor.
    """

    max_query_len: int = 1
    min_seq_len: int = 1024
    min_tokens_per_split: int = 256
    max_splits: int = 16
    programs_per_sm: int = 4

    def saturating_num_reqs(self, num_kv_heads: int, num_sms: int) -> int:
        """The request count from which :meth:`num_kv_splits` is 1 whatever the lengths: one
        program per (request, KV head) already gives every streaming multiprocessor
        ``programs_per_sm`` programs. Builders compare ``num_reqs`` against it before asking
        for the decision (a subclass that changes :meth:`num_kv_splits` keeps this bound
        true or changes it too).

        Examples:
            >>> SplitKVPolicy().saturating_num_reqs(num_kv_heads=8, num_sms=132)
            66
        """
        return -(-num_sms * self.programs_per_sm // max(1, num_kv_heads))

    def num_kv_splits(self, num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      num_sms: int) -> int:
        """The ``num_kv_splits`` for a step (1 = unified path). Host ints only; no sync.

        Examples:
            >>> p = SplitKVPolicy()
            >>> p.num_kv_splits(num_reqs=4, num_kv_heads=8, max_query_len=1, max_seq_len=8192, num_sms=132)
            16
            >>> p.num_kv_splits(num_reqs=256, num_kv_heads=8, max_query_len=1, max_seq_len=8192, num_sms=132)
            1
            >>> p.num_kv_splits(num_reqs=4, num_kv_heads=8, max_query_len=7, max_seq_len=8192, num_sms=132)
            1
        """
        if num_reqs == 0 or max_query_len > self.max_query_len or max_seq_len < self.min_seq_len:
            return 1
        programs = max(1, num_reqs * num_kv_heads)
        if programs >= num_sms * self.programs_per_sm:  # the GPU is full without splits
            return 1
        want = -(-num_sms * self.programs_per_sm // programs)
        splits = min(want, max(1, max_seq_len // self.min_tokens_per_split), self.max_splits)
        return 1 << (max(1, splits).bit_length() - 1)  # round down to a power of two
