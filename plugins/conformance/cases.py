"""Conformance cases: small, JSON-serializable descriptions of one attention workload.

A case says what the layer looks like (heads, KV heads, head size, dtype, window,
soft-cap), how the KV cache is paged (manager block size, kernel block size, block-id
order, pool size) and what each request has computed before the checked step and
schedules in it. The harness (``harness.py``) turns it into scheduler outputs:

* *history* steps compute each request's context (``num_computed_tokens``), in chunks of
  at most ``history_chunk`` tokens (every chunk is itself compared with the reference);
* the *checked* step schedules ``num_scheduled_tokens`` per request. A request with
  ``num_computed_tokens > 0`` and one scheduled token is a real decode (its prompt ended
  with the history and the token it decodes was sampled), any other is a prefill chunk.

Cases are plain data so a plugin author can add their own (``--attnplug-cases FILE``
takes a JSON list of case objects, see :meth:`ConformanceCase.from_dict`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence

DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
"""``kv_cache_dtype`` values (``core/kv_quant.py``); ``auto`` = the case's ``dtype``."""
KV_SCALES = ("per_tensor", "per_head")


@dataclass(frozen=True)
class ConformanceCase:
    """One workload. Lengths are tokens; the defaults make a tiny GQA fp32 layer.

    Attributes:
        name: unique id (shown in test ids and failure messages).
        requests: per request ``(num_computed_tokens, num_scheduled_tokens)``; the second
            must be >= 1.
        num_heads, num_kv_heads, head_size: the layer (``num_heads % num_kv_heads == 0``).
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (queries, K/V and cache).
        block_size: manager block size (tokens).
        kernel_block_size: the kernel block size to run with (must divide
            ``block_size``); ``None`` lets the backend pick, as the runner does.
        block_order: ``"permuted"`` (random, non-contiguous block ids) or ``"sequential"``.
        spare_blocks: extra poisoned blocks in the pool no request owns.
        sliding_window: W (current token included) or ``None``.
        logits_soft_cap: the cap or ``None``; queries are scaled up so it matters.
        scale: the softmax scale the impl is constructed with (``AttentionImpl(scale=)``),
            or ``None`` for ``head_size ** -0.5``. Models pass other values (Gemma's
            ``query_pre_attn_scalar ** -0.5``, Granite's ``attention_multiplier``), so an
            impl must use the one it is given.
        alibi: the impl gets ALiBi slopes (``AttentionImpl(alibi_slopes=)``, the standard
            ``2 ** (-8 (h + 1) / num_heads)``, ``oracle.alibi_slopes``); the oracle subtracts
            ``slope_h * (query position - key position)`` from the logits.
        sinks: the impl gets per-head sink logits (``AttentionImpl(sinks=)``, seeded,
            ``oracle.CaseInputs.sinks``); the oracle adds them as a softmax column with no value.
        num_pad_tokens: padded tokens appended to every step (``PAD_SLOT_ID`` slots).
        history_chunk: largest history chunk per request per step (``None``: all at once).
        seed: seeds Q/K/V and block ids.
        check_determinism: also run the case twice and demand bit-identical results.
        kv_cache_dtype: ``"auto"`` (the cache in ``dtype``) or ``"fp8_e4m3"`` / ``"fp8_e5m2"``:
            the cache is fp8, the impl gets non-unit ``k_scale`` / ``v_scale`` on its ``layer``
            argument, and the golden attends over the dequantised K/V (``oracle.case_kv_scales``).
        kv_scales: ``"per_head"`` (``[num_kv_heads]``, a different scale per head) or
            ``"per_tensor"`` (``[]``); fp8 cases only.
        tags: what the case covers (documentation and ``-k`` selection).
    """

    name: str
    requests: tuple[tuple[int, int], ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    dtype: str = "float32"
    block_size: int = 16
    kernel_block_size: int | None = None
    block_order: str = "permuted"
    spare_blocks: int = 3
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    scale: float | None = None
    sinks: bool = False
    alibi: bool = False
    num_pad_tokens: int = 0
    history_chunk: int | None = None
    seed: int = 0
    check_determinism: bool = False
    kv_cache_dtype: str = "auto"
    kv_scales: str = "per_head"
    tags: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        problems = []
        if not self.requests:
            problems.append("requests is empty")
        for i, pair in enumerate(self.requests):
            if len(pair) != 2 or pair[0] < 0 or pair[1] < 1:
                problems.append(f"requests[{i}]={pair!r}: need (num_computed_tokens >= 0, "
                                "num_scheduled_tokens >= 1)")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.kernel_block_size is not None and self.block_size % self.kernel_block_size:
            problems.append(f"kernel_block_size {self.kernel_block_size} does not divide block_size "
                            f"{self.block_size}")
        if self.block_order not in ("permuted", "sequential"):
            problems.append(f"block_order {self.block_order!r} not in ('permuted', 'sequential')")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            problems.append(f"logits_soft_cap must be > 0, got {self.logits_soft_cap}")
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool) and 0 < self.scale < float("inf")):
            problems.append(f"scale must be a finite number > 0 or null (head_size ** -0.5), got {self.scale!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype {self.kv_cache_dtype!r} not in {KV_CACHE_DTYPES}")
        if self.kv_scales not in KV_SCALES:
            problems.append(f"kv_scales {self.kv_scales!r} not in {KV_SCALES}")
        if problems:
            raise ValueError(f"conformance case {self.name!r}: " + "; ".join(problems))

    # --- derived facts --------------------------------------------------------------------
    @property
    def features(self) -> tuple[str, ...]:
        """Names in ``AttentionBackend.features()`` this case needs to be ``True``."""
        need = []
        if self.sliding_window is not None:
            need.append("sliding_window")
        if self.logits_soft_cap is not None:
            need.append("logits_soft_cap")
        if self.num_heads != self.num_kv_heads:
            need.append("mqa_gqa")
        if self.sinks:
            need.append("sinks")
        if self.alibi:
            need.append("alibi")
        return tuple(need)

    @property
    def softmax_scale(self) -> float:
        """The softmax scale: ``scale``, or ``head_size ** -0.5`` when it is ``None``."""
        return self.head_size ** -0.5 if self.scale is None else float(self.scale)

    def describe(self) -> str:
        """The case as one line of JSON (what failure messages show)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    # --- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["requests"] = [list(p) for p in self.requests]
        d["tags"] = list(self.tags)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConformanceCase":
        """Build a case from a JSON object (unknown keys are an error).

        Raises:
            ValueError: unknown keys or invalid values.
        """
        data = {k: v for k, v in data.items() if not (k == "kind" and v == "attention")}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"conformance case {data.get('name')!r}: unknown keys {unknown}; "
                             f"known: {sorted(known)}")
        data = dict(data)
        data["requests"] = tuple(tuple(int(x) for x in p) for p in data.get("requests", ()))
        data["tags"] = tuple(data.get("tags", ()))
        return cls(**data)


def read_case_list(path: str) -> list[dict]:
    """The JSON list of case objects in ``path`` (attention and state cases alike)."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, list) or not all(isinstance(d, dict) for d in raw):
        raise ValueError(f"{path}: expected a JSON list of conformance case objects")
    return raw


def load_cases(path: str) -> list[ConformanceCase]:
    """The attention cases of the JSON list in ``path`` (objects without ``"kind": "state"``)."""
    return [ConformanceCase.from_dict(d) for d in read_case_list(path) if d.get("kind", "attention") != "state"]


def _c(name: str, requests: Sequence[tuple[int, int]], *tags: str, **kw) -> ConformanceCase:
    return ConformanceCase(name=name, requests=tuple(tuple(r) for r in requests), tags=tags, **kw)


CASES: tuple[ConformanceCase, ...] = (
    # batch shapes
    _c("prefill_only", [(0, 7), (0, 16), (0, 23)], "prefill", num_heads=4, num_kv_heads=4, num_pad_tokens=3),
    _c("decode_only", [(5, 1), (16, 1), (33, 1), (1, 1)], "decode", "gqa", check_determinism=True),
    _c("mixed", [(10, 1), (0, 9), (20, 5), (31, 1)], "mixed", "gqa", num_heads=8, num_kv_heads=2,
       head_size=64, num_pad_tokens=5, check_determinism=True),
    _c("chunked_prefill_continuation", [(12, 7), (16, 16), (3, 1)], "chunked", history_chunk=5),
    _c("single_token_prompt", [(0, 1), (0, 2)], "prefill", "edge"),
    # heads
    _c("mqa", [(9, 1), (0, 6), (17, 3)], "mqa", num_heads=4, num_kv_heads=1, num_pad_tokens=2),
    _c("gqa_4_to_1_decode", [(40, 1), (7, 1)], "gqa", num_heads=8, num_kv_heads=2),
    _c("head_size_64", [(6, 1), (0, 11)], "head_size", head_size=64),
    _c("head_size_96", [(6, 1), (0, 5)], "head_size", head_size=96),
    _c("head_size_128", [(6, 1), (0, 5)], "head_size", head_size=128, num_heads=2, num_kv_heads=1),
    # paging
    _c("block_size_1", [(5, 1), (0, 4), (3, 2)], "blocks", block_size=1),
    _c("block_size_4", [(9, 1), (0, 10), (7, 3)], "blocks", block_size=4, num_pad_tokens=2),
    _c("block_32_kernel_16", [(35, 1), (0, 20), (18, 15)], "blocks", "kernel_block", block_size=32,
       kernel_block_size=16),
    _c("block_64_kernel_16", [(70, 1), (3, 9)], "blocks", "kernel_block", block_size=64, kernel_block_size=16),
    _c("sequential_block_ids", [(10, 1), (0, 9)], "blocks", block_order="sequential"),
    # sliding window
    _c("window_5_block_4", [(13, 1), (0, 11), (9, 6), (2, 1)], "window", sliding_window=5, block_size=4,
       num_pad_tokens=3, check_determinism=True),
    _c("window_7_chunked", [(20, 8), (11, 1)], "window", "chunked", sliding_window=7, block_size=4,
       history_chunk=6),
    _c("window_longer_than_seq", [(10, 1), (0, 12), (5, 4)], "window", sliding_window=64),
    _c("window_1", [(6, 1), (0, 3)], "window", "edge", sliding_window=1, block_size=4),
    # decodes whose window straddles cdiv(W - 1, B) + 1 > cdiv(W, B) blocks (W not 1 mod B)
    _c("window_6_block_4_straddles", [(12, 1), (15, 1), (8, 3), (0, 10)], "window", "blocks", sliding_window=6,
       block_size=4, num_pad_tokens=1),
    _c("window_8_block_8_kernel_4", [(9, 1), (20, 1), (6, 5)], "window", "kernel_block", sliding_window=8,
       block_size=8, kernel_block_size=4),
    # soft-cap
    _c("softcap", [(9, 1), (0, 8), (12, 4)], "softcap", logits_soft_cap=5.0, num_pad_tokens=2),
    _c("softcap_window", [(14, 1), (0, 10)], "softcap", "window", logits_soft_cap=8.0, sliding_window=6,
       block_size=4),
    # softmax scale other than head_size ** -0.5 (Gemma's query_pre_attn_scalar, scale 1.0)
    _c("scale_query_pre_attn_scalar", [(12, 1), (0, 9), (20, 5)], "scale", scale=256 ** -0.5, num_pad_tokens=2),
    _c("scale_one", [(9, 1), (0, 7), (15, 4)], "scale", "gqa", scale=1.0, num_heads=8, num_kv_heads=2),
    _c("scale_softcap_window", [(14, 1), (0, 10), (12, 4)], "scale", "softcap", "window", scale=0.5,
       logits_soft_cap=20.0, sliding_window=6, block_size=4),
    # dtypes
    _c("mixed_fp16", [(10, 1), (0, 9), (20, 5)], "dtype", dtype="float16", num_pad_tokens=2),
    _c("mixed_bf16", [(10, 1), (0, 9), (20, 5)], "dtype", dtype="bfloat16", num_pad_tokens=2),
    _c("window_fp16", [(13, 1), (0, 9)], "dtype", "window", dtype="float16", sliding_window=5, block_size=4),
    # attention sinks (gpt-oss): a per-head logit in the denominator, on full and windowed layers
    _c("sink_logits_gqa", [(10, 1), (0, 9), (20, 5)], "sinks", "gqa", sinks=True, num_pad_tokens=2),
    _c("sink_logits_sliding", [(13, 1), (0, 11), (9, 6)], "sinks", "window", "chunked", sinks=True,
       sliding_window=5, block_size=4, history_chunk=5),
    # ALiBi: - slope_h * (query position - key position) on the logits, on full and windowed layers
    _c("alibi_gqa", [(10, 1), (0, 9), (20, 5)], "alibi", "gqa", alibi=True, num_pad_tokens=2),
    _c("alibi_sliding_chunked", [(21, 1), (0, 11), (9, 6)], "alibi", "window", "chunked", alibi=True,
       sliding_window=5, history_chunk=5),
    # fp8 KV caches with non-unit scales (per KV head: ignoring them, or using head 0's for
    # every head, fails); the golden attends over the dequantised K/V
    _c("fp8_e4m3_per_head", [(10, 1), (0, 6), (12, 3)], "fp8", "gqa", kv_cache_dtype="fp8_e4m3",
       kv_scales="per_head", num_pad_tokens=2),
    _c("fp8_e5m2_per_tensor", [(9, 1), (0, 5)], "fp8", kv_cache_dtype="fp8_e5m2", kv_scales="per_tensor",
       num_pad_tokens=1),
)
"""The built-in catalog. Names are unique; each case is a few dozen tokens at most."""
