"""The sparse-attention conformance cases (docs/conformance.md, "Sparse attention").

Two families, one per contract of ``core/sparse.py``:

* selector cases (``selector_case``): one step of an indexer layer; per request the tokens
  already cached and this step's; queries see fewer, as many or more keys than
  ``index_topk``; ``ties`` duplicates key rows so that scores tie exactly.
* consumer cases (``sparse_mla_case``): one step of a sparse MLA layer with given
  ``topk_indices``; ``minus_ones`` puts ``-1`` entries among (not only after) the selected.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SelectorCase:
    """One selector step (``num_padded_tokens`` rows with ``PAD_SLOT_ID`` after the real ones)."""

    name: str
    num_computed_tokens: tuple[int, ...]
    num_scheduled_tokens: tuple[int, ...]
    index_topk: int = 8
    block_size: int = 16
    index_n_heads: int = 4
    index_head_dim: int = 16
    dtype: str = "float32"
    ties: bool = False
    num_padded_tokens: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass(frozen=True)
class SparseMLACase:
    """One sparse MLA step with ``index_topk`` given indices per query."""

    name: str
    num_computed_tokens: tuple[int, ...]
    num_scheduled_tokens: tuple[int, ...]
    index_topk: int = 8
    block_size: int = 16
    num_heads: int = 4
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    dtype: str = "float32"
    minus_ones: bool = True
    num_padded_tokens: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


SELECTOR_CASES: tuple[SelectorCase, ...] = (
    SelectorCase("decode_only", (7, 20, 33), (1, 1, 1)),
    SelectorCase("prefill_fresh", (0, 0), (5, 12)),
    SelectorCase("prefill_chunk_with_context", (19, 0, 30), (6, 1, 4)),
    SelectorCase("ties", (12, 0), (1, 9), ties=True),
    SelectorCase("padded_rows", (9, 0), (1, 4), num_padded_tokens=3),
    SelectorCase("block4_topk3", (10, 5), (2, 3), index_topk=3, block_size=4),
)
"""The built-in selector cases (ids ``test_selector_*[<backend>-<name>]``)."""

SPARSE_MLA_CASES: tuple[SparseMLACase, ...] = (
    SparseMLACase("decode_only", (7, 20, 33), (1, 1, 1)),
    SparseMLACase("prefill_chunk_with_context", (19, 0, 30), (6, 5, 2)),
    SparseMLACase("no_minus_one", (12, 30), (1, 3), minus_ones=False),
    SparseMLACase("padded_rows", (9, 0), (1, 4), num_padded_tokens=3),
    SparseMLACase("block4_topk3", (10, 5), (2, 3), index_topk=3, block_size=4),
    SparseMLACase("float16_mixed", (21, 0), (1, 5), dtype="float16"),
)
"""The built-in consumer cases (ids ``test_sparse_mla_*[<backend>-<name>]``)."""
