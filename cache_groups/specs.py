"""KV-cache specs: what one layer keeps per token (attention) or per request (Mamba).

Frozen dataclasses so that equal specs hash equal: layers with equal specs share a
cache group (``attnplug.cache_groups.grouping``). Names follow vLLM V1's
``vllm/v1/kv_cache_interface.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnplug.cache_groups.kinds import GroupKind
from attnplug.core.errors import KVCacheSpecError


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of every spec. ``block_size`` is tokens per manager block."""

    block_size: int

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise KVCacheSpecError(f"block_size must be a positive int, got {self.block_size!r}")

    @property
    def kind(self) -> GroupKind:
        """The group's :class:`~attnplug.cache_groups.kinds.GroupKind` (a ``str`` enum:
        ``"full_attention"``, ``"sliding_window"``, ``"mamba"``)."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (one layer)."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Upper bound of one request's cache bytes (one layer)."""
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Paged K/V: each block holds ``block_size`` tokens of K and V for ``num_kv_heads``."""

    num_kv_heads: int = 1
    head_size: int = 64
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_kv_heads", "head_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise KVCacheSpecError(f"{name} must be a positive int, got {v!r}")

    @property
    def page_size_bytes(self) -> int:
        """``2 * block_size * num_kv_heads * head_size * dtype size`` (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _dtype_bytes(self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full causal attention: a request keeps every token's K/V."""

    @property
    def kind(self) -> GroupKind:
        return GroupKind.FULL_ATTENTION

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """``cdiv(max_model_len, block_size)`` blocks."""
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one latent row per token, one "head".

    A token's row is ``[kv_c_normed (kv_lora_rank) | k_pe (qk_rope_head_dim)]``: the
    compressed KV after its RMSNorm, then the rotated RoPE key shared by every head
    (vLLM's ``MLAAttentionSpec`` and ``concat_and_cache_mla``; docs/mla.md). There is no
    separate V: values are up-projected from the latent. So ``num_kv_heads`` is 1,
    ``head_size`` is ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3), and a block
    holds ``block_size`` rows, not K and V halves.

    ``head_size`` and ``num_kv_heads`` are derived; passing other values than the derived
    ones raises. Blocks, prefix caching and block tables are those of full attention
    (a subclass of :class:`FullAttentionSpec`); the group kind is ``GroupKind.MLA`` so that
    only MLA backends serve it.

    Examples:
        >>> s = MLAAttentionSpec(block_size=64, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)
        >>> s.head_size, s.num_kv_heads, s.page_size_bytes, s.bytes_per_token
        (576, 1, 73728, 1152)
    """

    num_kv_heads: int = 1
    head_size: int = 0
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise KVCacheSpecError(f"{name} must be a positive int, got {v!r}")
        row = self.kv_lora_rank + self.qk_rope_head_dim
        if self.head_size not in (0, row):
            raise KVCacheSpecError(f"head_size {self.head_size} != kv_lora_rank {self.kv_lora_rank} + "
                                   f"qk_rope_head_dim {self.qk_rope_head_dim} (leave head_size out: it is derived)")
        if self.num_kv_heads != 1:
            raise KVCacheSpecError(f"num_kv_heads must be 1 for MLA (one latent row per token), got {self.num_kv_heads!r}")
        object.__setattr__(self, "head_size", row)
        super().__post_init__()

    @property
    def kind(self) -> GroupKind:
        return GroupKind.MLA

    @property
    def bytes_per_token(self) -> int:
        """``(kv_lora_rank + qk_rope_head_dim) * dtype size`` bytes of one layer's row."""
        return self.head_size * _dtype_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """``block_size * (kv_lora_rank + qk_rope_head_dim) * dtype size``: one row per token,
        no K/V halves."""
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention over the last ``sliding_window`` tokens (current included).

    Key k is visible to query p iff ``p - W < k <= p`` (HF ``config.sliding_window``).
    """

    sliding_window: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
            raise KVCacheSpecError(f"sliding_window must be a positive int, got {self.sliding_window!r}")

    @property
    def kind(self) -> GroupKind:
        return GroupKind.SLIDING_WINDOW

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """``cdiv(W - 1 + max_num_batched_tokens, block_size) + 1`` blocks, capped by the
        full-attention need: the window plus one step's tokens, and one block of slack
        because the window's first token rarely starts a block."""
        blocks = cdiv(self.sliding_window - 1 + max_num_batched_tokens, self.block_size) + 1
        return min(blocks, cdiv(max_model_len, self.block_size)) * self.page_size_bytes


@dataclass(frozen=True)
class StateTensorSpec:
    """One tensor a state layer keeps per request (per state slot).

    ``shape`` excludes the slot dimension: a layer's cache for this tensor is
    ``[num_slots, *shape]`` of ``dtype``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise KVCacheSpecError(f"state tensor name must be an identifier, got {self.name!r}")
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list)) else None
        if shape is None or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise KVCacheSpecError(f"state tensor {self.name!r}: shape must be a tuple of ints >= 0, got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise KVCacheSpecError(f"state tensor {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        """Elements of one slot's tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of one slot's tensor."""
        return self.numel * _dtype_bytes(self.dtype)


@dataclass(frozen=True)
class StateSpec(KVCacheSpec):
    """A recurrent-state layer: one slot per running request holding the tensors it declares.

    The group kind is ``GroupKind.MAMBA`` (a state group: one block = one state slot per
    request, no paged K/V) for every state kind; ``state_kind`` says which layer math the
    slots belong to (``"mamba2"``, ``"gdn"``, or a third party's name) and is what a
    state backend checks. Allocation (``StateBackend.allocate_state_cache``: one
    ``[num_slots, *shape]`` tensor per declared tensor, in declaration order), slot copies
    (prefix-caching checkpoints) and the page size all work from ``tensors``.

    Fields:
        block_size: the manager's accounting unit in tokens (one block per request).
        tensors: the per-slot tensors, in the order the layer's cache tuple holds them;
            names unique.
        state_kind: the layer math, e.g. ``"mamba2"``, ``"gdn"``.
        chunk_size: tokens per chunk of the kind's chunked prefill scan (``0``: none).
        page_size_padded: keyword-only, optional: the bytes one slot's page takes when
            it is padded to another group's page (vLLM's ``MambaSpec.page_size_padded``:
            the page of an attention block of ``block_size`` tokens, so the pools can
            share a page size); ``None``: the declared tensors' bytes. The declared
            tensors must fit in it.

    Raises:
        KVCacheSpecError: no tensors, a duplicate name, an empty ``state_kind``, a
            negative ``chunk_size``, or a ``page_size_padded`` the declared tensors do
            not fit in (one line naming the field, the bytes and the block size).

    Examples:
        >>> s = StateSpec(block_size=64, state_kind="gdn", chunk_size=64, tensors=(
        ...     StateTensorSpec("conv_state", (96, 3), torch.float32),
        ...     StateTensorSpec("recurrent_state", (4, 16, 16), torch.float32)))
        >>> s.page_size_bytes, s.tensor("conv_state").shape
        (5248, (96, 3))
    """

    tensors: tuple[StateTensorSpec, ...] = ()
    state_kind: str = "state"
    chunk_size: int = 0
    page_size_padded: int | None = field(default=None, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        tensors = tuple(self.tensors) if isinstance(self.tensors, (tuple, list)) else None
        if not tensors or not all(isinstance(t, StateTensorSpec) for t in tensors):
            raise KVCacheSpecError(f"a state spec declares at least one StateTensorSpec, got {self.tensors!r}")
        names = [t.name for t in tensors]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise KVCacheSpecError(f"state tensor names must be unique, repeated: {dup}")
        if not isinstance(self.state_kind, str) or not self.state_kind:
            raise KVCacheSpecError(f"state_kind must be a non-empty str, got {self.state_kind!r}")
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 0:
            raise KVCacheSpecError(f"chunk_size must be an int >= 0, got {self.chunk_size!r}")
        self._check_page(tensors)
        object.__setattr__(self, "tensors", tensors)

    def _check_page(self, tensors: tuple[StateTensorSpec, ...]) -> None:
        padded = self.page_size_padded
        if padded is None:
            return
        need = sum(t.nbytes for t in tensors)
        if not isinstance(padded, int) or isinstance(padded, bool) or padded < need:
            raise KVCacheSpecError(
                f"page_size_padded: {padded!r} bytes (the page of a block of {self.block_size} tokens) does not fit "
                f"the {self.state_kind} state's {need} bytes ({', '.join(f'{t.name} {t.nbytes}' for t in tensors)}); "
                "raise the block size or leave page_size_padded unset")

    @property
    def kind(self) -> GroupKind:
        return GroupKind.MAMBA

    def tensor(self, name: str) -> StateTensorSpec:
        """The declared tensor ``name``.

        Raises:
            KVCacheSpecError: no tensor of that name (the declared names listed).
        """
        for t in self.tensors:
            if t.name == name:
                return t
        raise KVCacheSpecError(f"{self.state_kind} state has no tensor {name!r} (declared: "
                               f"{', '.join(t.name for t in self.tensors)})")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one request's state: the sum of the declared tensors' bytes, or
        ``page_size_padded`` when set."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return sum(t.nbytes for t in self.tensors)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """One state slot, whatever the length."""
        return self.page_size_bytes


@dataclass(frozen=True)
class MambaSpec(StateSpec):
    """Mamba2 state: one slot per running request holding its conv and SSM states.

    ``conv_state_shape`` is ``[conv_dim, d_conv - 1]``; ``ssm_state_shape`` is
    ``[nheads, headdim, d_state]``. ``block_size`` is the manager's accounting unit
    (usually ``max_model_len``: one block per request). The declared tensors are derived:
    ``conv_state`` (``dtype``) then ``ssm_state`` (``ssm_dtype``); ``state_kind`` is
    ``"mamba2"``.
    """

    conv_state_shape: tuple[int, ...] = (1, 1)
    ssm_state_shape: tuple[int, ...] = (1, 1, 1)
    dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32
    chunk_size: int = 256
    state_kind: str = "mamba2"

    def __post_init__(self):
        object.__setattr__(self, "tensors", (StateTensorSpec("conv_state", tuple(self.conv_state_shape), self.dtype),
                                             StateTensorSpec("ssm_state", tuple(self.ssm_state_shape), self.ssm_dtype)))
        object.__setattr__(self, "state_kind", "mamba2")
        super().__post_init__()
