"""The MLA conformance cases: one step of an MLA layer each (docs/conformance.md, "MLA").

A case gives per request the tokens already cached (``num_computed_tokens``) and the
tokens of this step (``num_scheduled_tokens``); decodes (one token) come first, as the
builder's ``reorder_batch_threshold`` asks. Dimensions are tiny but keep the shapes of
DeepSeek's (``qk_nope_head_dim + qk_rope_head_dim`` a multiple of 16, ``v_head_dim`` smaller).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MLACase:
    """One MLA step. ``workspace_tokens`` ``None``: the builder's default (one chunk);
    ``num_padded_tokens`` extra token rows with ``PAD_SLOT_ID`` after the real ones."""

    name: str
    num_computed_tokens: tuple[int, ...]
    num_scheduled_tokens: tuple[int, ...]
    block_size: int = 16
    num_heads: int = 4
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    dtype: str = "float32"
    workspace_tokens: int | None = None
    num_padded_tokens: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def num_decodes(self) -> int:
        """Leading one-token rows."""
        n = 0
        for q in self.num_scheduled_tokens:
            if q > 1:
                break
            n += 1
        return n


MLA_CASES: tuple[MLACase, ...] = (
    MLACase("decode_only", (7, 20, 33), (1, 1, 1)),
    MLACase("prefill_fresh", (0, 0), (5, 12)),
    MLACase("mixed", (9, 30, 0, 17), (1, 1, 6, 4)),
    MLACase("chunked_context", (40, 25), (3, 2), workspace_tokens=4),
    MLACase("padded_rows", (5, 0), (1, 3), num_padded_tokens=3),
    MLACase("block32_mixed", (50, 12), (1, 7), block_size=32),
    MLACase("block64_mixed", (70, 3, 0), (1, 1, 9), block_size=64),
    MLACase("float16_mixed", (21, 0, 9), (1, 5, 3), dtype="float16"),
    MLACase("bfloat16_mixed", (21, 0, 9), (1, 5, 3), dtype="bfloat16"),
)
"""The built-in MLA cases (ids ``test_mla_*[<backend>-<name>]``)."""

ABSORB_CASE = MLACase("absorbed_vs_expanded", (13, 40, 3), (1, 1, 1))
"""Decodes served once by ``forward_mqa`` and once, the same step, by ``forward_mha``."""

CHUNK_CASE = MLACase("tiny_workspace", (37, 18, 0), (4, 2, 5), workspace_tokens=3)
"""Context chunked through a 3-row workspace, against the same step in one chunk."""

REENTRANT_CASES: tuple[MLACase, ...] = (MLA_CASES[2], MLA_CASES[0], CHUNK_CASE)


def fitted(case: MLACase, backend_cls) -> MLACase:
    """``case`` at a block size the backend declares (its smallest one when 16 is not)."""
    sizes = getattr(backend_cls, "supported_kernel_block_sizes", None)
    if sizes is None or case.block_size in sizes:
        return case
    return replace(case, block_size=min(sizes))
"""Built one after another by ONE builder, then run (re-entrancy)."""
