"""The MLA side of the backend contract: multi-head latent attention (DeepSeek-V2/V3).

An MLA layer caches one *latent row* per token, ``[kv_c_normed | k_pe]`` of
``kv_lora_rank + qk_rope_head_dim`` values, instead of per-head K and V. Per head ``n``,
``kv_b_proj`` up-projects the latent into a key part ``k_nope = W_UK[n] @ kv_c``
(``qk_nope_head_dim``) and a value ``v = W_UV[n] @ kv_c`` (``v_head_dim``); every head
shares the rotated ``k_pe``. A query is ``[q_nope | q_pe]`` per head. The same
attention is computed two ways (docs/mla.md has the shapes):

* **prefill** (:meth:`MLAImpl.forward_mha`): up-project the latents of the new tokens
  (and, chunk by chunk through a bounded workspace, of the cached context) and run
  ordinary multi-head attention with head size ``qk_nope_head_dim + qk_rope_head_dim``
  for q/k and ``v_head_dim`` for v; partial results over context chunks are merged by
  their log-sum-exp.
* **decode** (:meth:`MLAImpl.forward_mqa`): absorb ``W_UK`` into the query
  (``ql_nope = q_nope @ W_UK``, ``kv_lora_rank`` wide) and attend with ONE shared KV head
  over the latent rows themselves (key = the whole row, value = its first
  ``kv_lora_rank`` values); the result is a latent ``[kv_lora_rank]`` per head that the
  caller up-projects with ``W_UV``. No per-token up-projection of the context.

Both give the same numbers (``q_nope . k_nope = (q_nope W_UK) . kv_c``). The contract
here is what a kernel author writes to: the builder lowers the step's
:class:`~attnplug.core.metadata.CommonAttentionMetadata` into :class:`MLAMetadata` (decodes
first, then prefills, each with its sub-metadata); the impl provides ``forward_mqa`` and
``forward_mha``; the shared orchestration (cache write, absorption, chunked context,
merging) is ``attnplug.backends.mla.common``'s. Names follow vLLM's MLA backends
(``vllm/v1/attention/backends/mla/common.py``: ``forward_mha``, ``forward_mqa``,
``kv_lora_rank``, ``qk_rope_head_dim``, ``concat_and_cache_mla``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnplug.core.contracts import AttentionBackend, AttentionType

MLA_DIM_FIELDS: tuple[str, ...] = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The dimensions of an MLA layer, HF DeepSeek config names (``num_attention_heads`` is
``num_heads`` here)."""


def mla_dim_problems(dims: dict[str, Any]) -> list[str]:
    """Every problem with an MLA layer's dimensions, each naming its field (empty: fine).

    Args:
        dims: ``{name: value}`` for :data:`MLA_DIM_FIELDS` (missing names are problems),
            optionally ``q_lora_rank`` (``None`` or a positive int) and ``head_dim``
            (HF's derived head size: must equal ``qk_nope_head_dim + qk_rope_head_dim``
            when present).
    """
    problems = []
    for name in MLA_DIM_FIELDS:
        v = dims.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            problems.append(f"{name} must be a positive int, got {v!r}")
    q_lora = dims.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or isinstance(q_lora, bool) or q_lora <= 0):
        problems.append(f"q_lora_rank must be a positive int or null, got {q_lora!r}")
    rope = dims.get("qk_rope_head_dim")
    if isinstance(rope, int) and rope > 0 and rope % 2:
        problems.append(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {rope}")
    head_dim, nope = dims.get("head_dim"), dims.get("qk_nope_head_dim")
    if head_dim is not None and isinstance(nope, int) and isinstance(rope, int) and head_dim != nope + rope:
        problems.append(f"head_dim {head_dim!r} != qk_nope_head_dim {nope} + qk_rope_head_dim {rope}")
    return problems


@dataclass(frozen=True)
class MLALayerConfig:
    """What an MLA layer needs of a backend (the selection input; the impl's constructor).

    ``head_size`` (the cache row: ``kv_lora_rank + qk_rope_head_dim``) and
    ``num_kv_heads`` (1) are derived, so selection messages and generic tools read an MLA
    layer like any other.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype | None = None
    block_size: int = 16
    attn_type: AttentionType = AttentionType.DECODER
    device: str = "cpu"

    @property
    def head_size(self) -> int:
        """The latent row: ``kv_lora_rank + qk_rope_head_dim`` values."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_kv_heads(self) -> int:
        """1: every head reads the same latent row."""
        return 1

    @property
    def qk_head_dim(self) -> int:
        """``qk_nope_head_dim + qk_rope_head_dim``: q/k head size of the prefill MHA."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def effective_kv_cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    def problems(self) -> list[str]:
        """:func:`mla_dim_problems` of this config's dimensions."""
        return mla_dim_problems({f: getattr(self, f) for f in MLA_DIM_FIELDS})


@dataclass(frozen=True)
class MLADecodeMetadata:
    """The decode rows of an MLA step: rows ``0 .. num_decodes - 1``, one query each.

    Every tensor is on the compute device. A backend's builder may subclass this to carry
    its kernel's own plan (``FlashMLA``'s tile scheduler, a FlashInfer wrapper).
    """

    num_decodes: int
    """Decode requests (= decode tokens: one query each)."""
    block_table: torch.Tensor
    """``[num_decodes, max_num_blocks_per_req]``, ``torch.int32``; kernel block ids."""
    seq_lens: torch.Tensor
    """``[num_decodes]``, ``torch.int32``; tokens of latent per request, this step's included."""
    max_seq_len: int
    """``max(seq_lens)`` (tokens)."""


@dataclass(frozen=True)
class MLAContextChunk:
    """One chunk of the prefills' cached context, gathered into the workspace at once.

    Request ``r`` (``0 .. num_prefills - 1``) contributes its context tokens
    ``starts[r] .. starts[r] + seq_lens[r] - 1``; their latent rows are gathered in request
    order into workspace rows ``cu_seq_lens[r] .. cu_seq_lens[r + 1] - 1``.
    """

    cu_seq_lens: torch.Tensor
    """``[num_prefills + 1]``, ``torch.int32``, device; exclusive prefix sum of the chunk's
    per-request token counts (the ``cu_seqlens_k`` of this chunk's MHA)."""
    slots: torch.Tensor
    """``[total_tokens]``, ``torch.int64``, device; the cache slot of each gathered token."""
    max_seq_len: int
    """Longest per-request part of the chunk (tokens)."""
    total_tokens: int
    """Rows of the workspace the chunk fills (``<= workspace_tokens``)."""


@dataclass(frozen=True)
class MLAPrefillMetadata:
    """The prefill rows of an MLA step: rows ``num_decodes .. num_reqs - 1``.

    Tokens are those of the flat stream from ``num_decode_tokens`` on; ``query_start_loc``
    counts from there.
    """

    num_prefills: int
    """Prefill requests (query longer than the decode threshold, or after a long one)."""
    query_start_loc: torch.Tensor
    """``[num_prefills + 1]``, ``torch.int32``, device; relative to the first prefill token."""
    max_query_len: int
    """Longest prefill query (tokens)."""
    context_lens: torch.Tensor
    """``[num_prefills]``, ``torch.int32``, CPU; tokens cached before this step."""
    chunks: tuple[MLAContextChunk, ...]
    """The cached context in workspace-sized chunks (empty: no prefill has context)."""
    workspace_tokens: int
    """Rows the impl's workspace must hold: ``max(chunk.total_tokens)`` (0 without chunks)."""


@dataclass(frozen=True)
class MLAMetadata:
    """What every layer of an MLA group reads in one step (the builder's product)."""

    num_reqs: int
    """Real requests; decodes are rows ``0 .. num_decodes - 1``."""
    num_actual_tokens: int
    """Real tokens; rows past it are never read or written."""
    num_decodes: int
    """Requests served by ``forward_mqa``."""
    num_decode_tokens: int
    """Their tokens (the first ``num_decode_tokens`` of the stream)."""
    num_prefills: int
    """Requests served by ``forward_mha``."""
    block_size: int
    """Tokens per kernel block; ``kv_cache.shape[1]``."""
    slot_mapping: torch.Tensor
    """``[num_tokens]``, ``torch.int64``, device (as given; ``PAD_SLOT_ID`` = not written)."""
    decode: MLADecodeMetadata | None
    """``None`` when the step has no decode."""
    prefill: MLAPrefillMetadata | None
    """``None`` when the step has no prefill."""


class MLABackend(AttentionBackend):
    """Base of backends that serve MLA cache groups (``kv_cache_kind = "mla"``).

    KV cache per layer: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``
    (:meth:`get_kv_cache_shape` with ``num_kv_heads == 1``); row ``[:kv_lora_rank]`` is the
    normalised latent, ``[kv_lora_rank:]`` the rotated ``k_pe``. The impl class is an
    :class:`MLAImpl`, built as ``Impl(layer_config, scale)``. Subclasses declare
    ``supported_kv_lora_ranks`` / ``supported_qk_rope_head_dims`` (``None``: any) on top of
    the usual dtype, block size and device declarations.
    """

    kv_cache_kind: ClassVar[str] = "mla"
    sparse: ClassVar[bool] = False
    """``True``: serves sparse MLA layers (``index_topk``, ``core/sparse.py``) instead of dense ones."""
    supported_kv_lora_ranks: ClassVar[tuple[int, ...] | None] = None
    supported_qk_rope_head_dims: ClassVar[tuple[int, ...] | None] = None

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """``[num_blocks, block_size, head_size]``: one latent row per token
        (``num_kv_heads`` must be 1)."""
        if num_kv_heads != 1:
            raise ValueError(f"an MLA cache has one KV head (the latent row), got num_kv_heads={num_kv_heads}")
        return (num_blocks, block_size, head_size)

    @classmethod
    def split_kv_cache(cls, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latent rows, latent rows)`` as ``[num_blocks, block_size, 1, head_size]`` views:
        an MLA cache has no separate V; both halves are the one row."""
        rows = kv_cache.unsqueeze(2)
        return rows, rows

    @classmethod
    def supports_mqa_gqa(cls) -> bool:
        return True

    @classmethod
    def validate_configuration(cls, layer: Any) -> list[str]:
        """Every reason this backend cannot serve ``layer`` (an :class:`MLALayerConfig`).

        A layer that is not an MLA layer (no ``kv_lora_rank``) is refused with one reason.
        """
        ok, why = cls.is_available()
        reasons = [] if ok else [f"not available on this machine: {why}"]
        if not hasattr(layer, "kv_lora_rank"):
            return reasons + ["serves MLA layers only (the layer has no kv_lora_rank)"]
        reasons += layer.problems()
        if getattr(layer, "index_topk", None) is not None and not cls.sparse:
            reasons.append("dense MLA: the layer attends to index_topk selected tokens only (DeepSeek-V3.2): "
                           "use a sparse MLA backend")
        if layer.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {layer.dtype} not supported (supported: "
                           f"{', '.join(str(d) for d in cls.supported_dtypes)})")
        for name, allowed in (("kv_lora_rank", cls.supported_kv_lora_ranks),
                              ("qk_rope_head_dim", cls.supported_qk_rope_head_dims)):
            if allowed is not None and getattr(layer, name) not in allowed:
                reasons.append(f"{name} {getattr(layer, name)} not supported (supported: {list(allowed)})")
        if cls.get_supported_kernel_block_size(layer.block_size) is None:
            reasons.append(f"block_size {layer.block_size} is not a multiple of any supported kernel "
                           f"block size {list(cls.supported_kernel_block_sizes or ())}")
        dev = torch.device(layer.device).type
        if dev not in cls.supported_devices:
            reasons.append(f"device {dev!r} not supported (supported: {list(cls.supported_devices)})")
        elif dev == "cuda" and ok and not torch.cuda.is_available():
            reasons.append("device 'cuda' requested but torch.cuda.is_available() is False")
        if layer.attn_type not in cls.supported_attn_types:
            reasons.append(f"attention type {AttentionType(layer.attn_type).value!r} not supported")
        return reasons


class MLAImpl(ABC):
    """Runs one MLA layer with the metadata its builder made. ``Impl(layer_config, scale)``.

    ``forward`` (the whole layer step; ``attnplug.backends.mla.common.MLACommonImpl``
    implements it once for every backend) writes the cache, then serves decodes with
    :meth:`forward_mqa` and prefills with :meth:`forward_mha`. A backend implements the
    two kernels; it may also override the cache write.

    ``scale`` is the softmax scale of ``q . k`` in both phases (``qk_head_dim ** -0.5``,
    times YaRN's ``mscale ** 2`` where the model uses it).
    """

    def __init__(self, layer_config: MLALayerConfig, scale: float):
        self.layer_config = layer_config
        self.num_heads = layer_config.num_heads
        self.kv_lora_rank = layer_config.kv_lora_rank
        self.qk_nope_head_dim = layer_config.qk_nope_head_dim
        self.qk_rope_head_dim = layer_config.qk_rope_head_dim
        self.v_head_dim = layer_config.v_head_dim
        self.scale = float(scale)
        # the attention-impl view of the layer, for registries of live layer parameters
        # (backends/common/layer_params.py): one KV "head" of the latent row, no window
        self.num_kv_heads = 1
        self.head_size = layer_config.head_size
        self.sliding_window = None
        self.logits_soft_cap = None
        self.kv_cache_dtype = layer_config.kv_cache_dtype

    @abstractmethod
    def forward(self, layer: Any, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor) -> torch.Tensor:
        """Write this step's latent rows at the slot mapping, then attend.

        Args:
            layer: the calling module; ``layer.kv_b_proj.weight`` is ``[num_heads *
                (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` (HF ``kv_b_proj``: per
                head, the ``k_nope`` rows then the ``v`` rows).
            q: ``[num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim]``, the layer
                dtype; ``q_pe`` (the last ``qk_rope_head_dim``) already rotated.
            kv_c_normed: ``[num_tokens, kv_lora_rank]``: the latent after ``kv_a_layernorm``.
            k_pe: ``[num_tokens, qk_rope_head_dim]`` (or ``[num_tokens, 1, ...]``), rotated.
            kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``.
            attn_metadata: the group's :class:`MLAMetadata` (or a subclass) for this step.
            output: ``[num_tokens, num_heads, v_head_dim]``, written for the first
                ``num_actual_tokens`` rows.

        Returns:
            ``output``. Must not synchronise with the host.
        """

    @abstractmethod
    def forward_mqa(self, q: torch.Tensor, kv_cache: torch.Tensor,
                    decode: MLADecodeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode: multi-query attention of absorbed queries over the latent cache.

        Args:
            q: ``[num_decodes, num_heads, kv_lora_rank + qk_rope_head_dim]``:
                ``[q_nope @ W_UK | q_pe]`` per head, the cache dtype.
            kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``.
            decode: the step's :class:`MLADecodeMetadata`; query ``b`` is the last token of
                request ``b`` (position ``seq_lens[b] - 1``) and sees its keys
                ``0 .. seq_lens[b] - 1``.

        Returns:
            ``(o, lse)``: ``o`` ``[num_decodes, num_heads, kv_lora_rank]`` (the softmax-weighted
            latent, before ``W_UV``), in ``q``'s dtype; ``lse`` ``[num_heads, num_decodes]``,
            ``torch.float32``, natural-log sum-exp of the scaled logits.
        """

    @abstractmethod
    def forward_mha(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill: varlen multi-head attention over up-projected keys and values.

        Args:
            q: ``[total_q, num_heads, qk_nope_head_dim + qk_rope_head_dim]``.
            k: ``[total_k, num_heads, qk_nope_head_dim + qk_rope_head_dim]``.
            v: ``[total_k, num_heads, v_head_dim]``.
            cu_seqlens_q, cu_seqlens_k: ``[batch + 1]``, ``torch.int32``, device.
            max_seqlen_q, max_seqlen_k: the longest of each (Python ints).
            causal: bottom-right aligned (query ``j`` of a request of ``n_q`` queries and
                ``n_k`` keys sees keys ``0 .. n_k - n_q + j``); ``False``: every key.

        Returns:
            ``(out, lse)``: ``out`` ``[total_q, num_heads, v_head_dim]`` in ``q``'s dtype;
            ``lse`` ``[num_heads, total_q]``, ``torch.float32``, natural log (``-inf`` for a
            query that saw no key; its ``out`` row is then zero).
        """
