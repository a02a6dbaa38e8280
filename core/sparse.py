"""The sparse-attention side of the backend contract: a selector and a consumer.

DeepSeek-V3.2's sparse attention (DSA) splits one attention layer into two contracts
(TensorRT-LLM's framing; vLLM keeps the indexer as a backend of its own):

* the **selector** ("which tokens"): a lightweight indexer scores every key its query may
  see and keeps the ``index_topk`` best. Its keys live in their own cache group (an
  :class:`~attnplug.cache_groups.indexer_spec.IndexerSpec`, kind ``indexer``). Contract:
  :class:`SelectorImpl`, metadata :class:`SelectorMetadata`, backends with
  ``kv_cache_kind = "indexer"`` (:class:`SelectorBackend`).
* the **consumer** ("attend to them"): MLA over the latent cache restricted to the
  selected tokens. Contract: :class:`SparseMLAImpl`, metadata :class:`SparseMLAMetadata`,
  backends with ``kv_cache_kind = "mla"`` and ``sparse = True`` (:class:`SparseMLABackend`).

The hand-off between them is ``topk_indices`` ``[num_tokens, index_topk]``, ``torch.int32``:
for each query token, positions of tokens *of its own request* (``0 .. seq_len - 1``,
request-relative, so each side maps them through its own group's block table), ``-1`` for
"none" (a query that sees fewer than ``index_topk`` keys). Scoring (HF
``DeepseekV32Indexer``; docs/mla.md, "The sparse path")::

    score[t, j] = sum_h weights[t, h] * relu(scale * q[t, h] . k[j])      j in key range of t

with ``scale = index_head_dim ** -0.5`` and ``weights`` already multiplied by
``index_n_heads ** -0.5`` by the caller. The selection is the ``index_topk`` highest
scores, in descending order of score; ties go to the lower position (a total order, so
every conforming selector returns the same indices).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnplug.core.contracts import AttentionBackend, AttentionType
from attnplug.core.mla import MLABackend, MLAImpl, MLALayerConfig


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True)
class IndexerLayerConfig:
    """What an indexer (selector) layer needs of a backend (selection input; impl constructor).

    Fields are HF ``DeepseekV32Config`` names: ``index_n_heads`` query heads of
    ``index_head_dim`` each, one shared key row per token, ``index_topk`` tokens kept per
    query. ``head_size`` (= ``index_head_dim``) and ``num_kv_heads`` (1) are derived so
    generic tools read it like an attention layer.
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    attn_type: AttentionType = AttentionType.DECODER
    device: str = "cpu"

    @property
    def head_size(self) -> int:
        return self.index_head_dim

    @property
    def num_kv_heads(self) -> int:
        return 1

    def problems(self) -> list[str]:
        """Every problem with the dimensions, each naming its field (empty: fine)."""
        return [f"{n} must be a positive int, got {getattr(self, n)!r}"
                for n in ("index_n_heads", "index_head_dim", "index_topk") if not _positive_int(getattr(self, n))]


@dataclass(frozen=True)
class SparseMLALayerConfig(MLALayerConfig):
    """An MLA layer that attends only to the ``index_topk`` tokens its selector picked.

    Dense MLA backends refuse it (their attention would see every token); a
    :class:`SparseMLABackend` serves it.
    """

    index_topk: int = 2048

    def problems(self) -> list[str]:
        extra = [] if _positive_int(self.index_topk) else [f"index_topk must be a positive int, got {self.index_topk!r}"]
        return super().problems() + extra


@dataclass(frozen=True)
class TokenRanges:
    """Per query token of a step: its request and the keys it may see (both sides share it).

    Built by ``attnplug.backends.sparse.common.token_ranges`` from the common metadata.
    Every tensor is on the compute device; rows ``num_actual_tokens ..`` are padding (their
    range is empty).
    """

    req_of_token: torch.Tensor
    """``[num_tokens]``, ``torch.int64``: the batch row (request) of each token (padding: 0)."""
    key_start: torch.Tensor
    """``[num_tokens]``, ``torch.int32``: first position (request-relative) the token may see
    (0 for causal attention over the whole request)."""
    key_end: torch.Tensor
    """``[num_tokens]``, ``torch.int32``: one past the last: ``position + 1`` (causal: a
    prefill chunk's query ``j`` sees ``0 .. context_len + j``; a decode sees ``0 ..
    seq_len - 1``); 0 for padding."""
    max_key_len: int
    """``max(key_end - key_start)`` (tokens; ``max_seq_len`` of the step)."""


@dataclass(frozen=True)
class SelectorMetadata:
    """What every selector layer of an ``indexer`` group reads in one step (builder's product)."""

    num_reqs: int
    """Real requests."""
    num_actual_tokens: int
    """Real query tokens; rows past it get ``-1`` everywhere."""
    block_size: int
    """Tokens per kernel block; ``kv_cache.shape[1]``."""
    slot_mapping: torch.Tensor
    """``[num_tokens]``, ``torch.int64``: where each token's key row is written
    (``PAD_SLOT_ID`` = not written)."""
    block_table: torch.Tensor
    """``[num_reqs, max_num_blocks_per_req]``, ``torch.int32``: kernel block ids of the
    indexer group."""
    seq_lens: torch.Tensor
    """``[num_reqs]``, ``torch.int32``: tokens per request, this step's included."""
    ranges: TokenRanges
    """Each query's request and key range (prefill chunks and decodes alike)."""


@dataclass(frozen=True)
class SparseMLAMetadata:
    """What every sparse MLA layer of an ``mla`` group reads in one step."""

    num_reqs: int
    num_actual_tokens: int
    block_size: int
    """Tokens per kernel block of the latent cache."""
    slot_mapping: torch.Tensor
    """``[num_tokens]``, ``torch.int64``: latent-row slots of this step's tokens."""
    block_table: torch.Tensor
    """``[num_reqs, max_num_blocks_per_req]``, ``torch.int32``: the MLA group's kernel block ids."""
    ranges: TokenRanges
    """Each query's request and key range (``topk_indices`` outside it are a contract breach)."""


class SelectorBackend(AttentionBackend):
    """Base of selector backends (``kv_cache_kind = "indexer"``).

    Cache per layer: ``[num_blocks, block_size, index_head_dim]``, one key row per token.
    The impl is a :class:`SelectorImpl`, built as ``Impl(layer_config, scale)``.
    """

    kv_cache_kind: ClassVar[str] = "indexer"

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """``[num_blocks, block_size, head_size]`` (``num_kv_heads`` must be 1)."""
        if num_kv_heads != 1:
            raise ValueError(f"an indexer cache has one key row per token, got num_kv_heads={num_kv_heads}")
        return (num_blocks, block_size, head_size)

    @classmethod
    def split_kv_cache(cls, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = kv_cache.unsqueeze(2)
        return rows, rows

    @classmethod
    def validate_configuration(cls, layer: Any) -> list[str]:
        """Every reason this backend cannot serve ``layer`` (an :class:`IndexerLayerConfig`)."""
        ok, why = cls.is_available()
        reasons = [] if ok else [f"not available on this machine: {why}"]
        if not hasattr(layer, "index_head_dim"):
            return reasons + ["serves sparse-attention indexer layers only (the layer has no index_head_dim)"]
        reasons += layer.problems()
        if layer.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {layer.dtype} not supported (supported: "
                           f"{', '.join(str(d) for d in cls.supported_dtypes)})")
        if cls.get_supported_kernel_block_size(layer.block_size) is None:
            reasons.append(f"block_size {layer.block_size} is not a multiple of any supported kernel "
                           f"block size {list(cls.supported_kernel_block_sizes or ())}")
        dev = torch.device(layer.device).type
        if dev not in cls.supported_devices:
            reasons.append(f"device {dev!r} not supported (supported: {list(cls.supported_devices)})")
        return reasons


class SelectorImpl(ABC):
    """Writes the step's indexer keys and picks each query's top-k. ``Impl(layer_config, scale)``.

    ``scale`` multiplies ``q . k`` before the ReLU (``index_head_dim ** -0.5`` for DeepSeek-V3.2).
    """

    def __init__(self, layer_config: IndexerLayerConfig, scale: float):
        self.layer_config = layer_config
        self.index_n_heads = layer_config.index_n_heads
        self.index_head_dim = layer_config.index_head_dim
        self.index_topk = layer_config.index_topk
        self.scale = float(scale)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: SelectorMetadata, topk_indices: torch.Tensor) -> torch.Tensor:
        """Write ``k`` at the slot mapping, then select.

        Args:
            q: ``[num_tokens, index_n_heads, index_head_dim]``, rotated (RoPE) already.
            k: ``[num_tokens, index_head_dim]``: this step's key rows, rotated.
            weights: ``[num_tokens, index_n_heads]``, ``torch.float32``: per-head weights,
                ``index_n_heads ** -0.5`` included.
            kv_cache: ``[num_blocks, block_size, index_head_dim]``.
            attn_metadata: the group's :class:`SelectorMetadata`.
            topk_indices: ``[num_tokens, index_topk]``, ``torch.int32``, written whole:
                request-relative positions in the query's key range, by descending score
                (ties: lower position first), ``-1`` after the last selected; padding rows all ``-1``.

        Returns:
            ``topk_indices``. Must not synchronise with the host.
        """


class SparseMLABackend(MLABackend):
    """Base of sparse MLA (consumer) backends: serve ``mla`` groups of layers with
    ``index_topk`` (:class:`SparseMLALayerConfig`); the impl is a :class:`SparseMLAImpl`."""

    sparse: ClassVar[bool] = True

    @classmethod
    def validate_configuration(cls, layer: Any) -> list[str]:
        reasons = super().validate_configuration(layer)
        if hasattr(layer, "kv_lora_rank") and getattr(layer, "index_topk", None) is None:
            reasons.append("serves sparse MLA layers only (the layer has no index_topk: use a dense MLA backend)")
        return reasons


class SparseMLAImpl(MLAImpl):
    """Sparse MLA: each query attends (absorbed, one shared latent head) to the latent rows of
    the tokens its selector picked. ``Impl(layer_config, scale)``."""

    @abstractmethod
    def forward(self, layer: Any, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: SparseMLAMetadata, output: torch.Tensor,
                topk_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Write the latent rows at the slot mapping, then attend to the selected tokens.

        Args: as :meth:`MLAImpl.forward`, plus ``topk_indices`` ``[num_tokens, index_topk]``,
        ``torch.int32``: the selector's output (``-1`` = none; required).

        Returns:
            ``output`` ``[num_tokens, num_heads, v_head_dim]``, rows ``< num_actual_tokens`` written.
        """

    @abstractmethod
    def forward_sparse(self, q: torch.Tensor, kv_cache: torch.Tensor,
                       slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The consumer kernel: absorbed MQA of each query over the latent rows at ``slots``.

        Args:
            q: ``[num_tokens, num_heads, kv_lora_rank + qk_rope_head_dim]``: ``[q_nope @ W_UK | q_pe]``.
            kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``.
            slots: ``[num_tokens, index_topk]``, ``torch.int64``: flat row indices of
                ``kv_cache.view(-1, row)`` (FlashMLA's sparse ``indices``); ``-1`` = none,
                never read.

        Returns:
            ``(o, lse)``: ``o`` ``[num_tokens, num_heads, kv_lora_rank]`` in ``q``'s dtype (zero
            for a query with no slot); ``lse`` ``[num_heads, num_tokens]``, ``torch.float32``
            (``-inf`` for a query with no slot).
        """

    def forward_mqa(self, q, kv_cache, decode):
        raise NotImplementedError("a sparse MLA impl attends through forward_sparse")

    def forward_mha(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        raise NotImplementedError("a sparse MLA impl attends through forward_sparse")


__all__ = ["IndexerLayerConfig", "SelectorBackend", "SelectorImpl", "SelectorMetadata", "SparseMLABackend",
           "SparseMLAImpl", "SparseMLALayerConfig", "SparseMLAMetadata", "TokenRanges"]
