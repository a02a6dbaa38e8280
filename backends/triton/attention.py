"""``paged_attention``: the Python entry point of the unified and split-KV attention kernels.

Chooses the tile sizes (:func:`choose_tiles`), then launches

* ``NUM_SEGMENTS == 1`` (unified): ONE launch of ``paged_attention_kernel`` for the whole
  varlen batch (prefills, chunked-prefill continuations and decodes mixed), output
  normalised in place;
* ``num_kv_splits > 1`` (split-KV, for decode-heavy batches with long contexts): the same
  kernel over ``num_kv_splits`` key segments per (query tile, KV head), writing fp32
  partials, then ``reduce_segments_kernel`` combining them (two launches).

See ``attention_kernels.py`` for the work decomposition. Nothing here synchronises with
the host: the grid depends only on ``query.shape[0]``, ``num_reqs`` and the heads.

Optional inputs of :func:`paged_attention` (each ``None`` by default, then not used), on
``query``'s device:

* ``visited_tiles``, a test aid: ``[num_query_tiles(...), num_kv_heads, num_kv_splits]``
  ``torch.int32``; each program stores how many key tiles (of ``choose_tiles(...).tile_n``
  keys) it visited. Programs without queries leave their entry unchanged.
* ``lse``: ``[num_tokens, num_heads]`` ``torch.float32`` (any strides): each real (token,
  head) row's log-sum-exp of its scaled, capped logits is stored there, in natural log
  (``-inf`` for a query that saw no key), as ``backends/common/merge.merge_attn_states``
  takes it (transposed). Needs ``num_kv_splits == 1``. Cascade attention's passes use it.
* ``sinks``: ``[num_heads]`` ``torch.float32``, per-head sink logits
  (``core/contracts.AttentionImpl``): one more logit in each row's softmax denominator, no
  value; counted once with ``num_kv_splits > 1`` (the first segment starts its online
  softmax at the sink), and included in ``lse``.
* ``alibi_slopes``: ``[num_heads]`` ``torch.float32``, ALiBi: each logit gets
  ``- slope_h * (query position - key position)`` after scale and soft-cap (vLLM's
  ``alibi_slopes``).
* ``k_scale``, ``v_scale``: an fp8 cache's descales, float32 ``[]`` or ``[num_kv_heads]``
  (``None``: 1.0); real = stored * scale (``core/kv_quant.py``). The kernel casts fp8 K/V
  tiles to the query's dtype, folds ``k_scale`` into the softmax scale and ``v_scale`` into
  the accumulator (one KV head per program).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnplug.backends.triton.constants import MAX_HEAD_SIZE
from attnplug.backends.triton.runtime import compute_capability, interpreting, kernel_module, launch
from attnplug.backends.common.value_checks import check_batch, values_checked
from attnplug.core.errors import MetadataError
from attnplug.core.kv_quant import is_quantized, per_head_scales

REDUCE_ELEMENTS_PER_PROGRAM = 4096
"""fp32 partial-output elements one split-KV reduce program combines (heads x segments x
padded head size): bounds its registers on a GPU and its launches in the interpreter."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one attention call.

    Attributes:
        block_m: query rows per program (``block_q`` tokens x the query heads of one KV head).
        block_q: query tokens per program, ``block_m // num_queries_per_kv``.
        tile_n: keys per inner-loop iteration.
        num_warps, num_stages: Triton launch options (ignored by the interpreter).
    """

    block_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int


def choose_tiles(max_query_len: int, num_queries_per_kv: int, head_size: int,
                 dtype: torch.dtype = torch.float16, *, interpreter: bool | None = None,
                 sm: int | None = None) -> TileConfig:
    """Tile sizes for a batch whose longest query has ``max_query_len`` tokens.

    GPU (``interpreter=False``): decode-like batches (``max_query_len`` no more than the
    tokens a 16-row tile holds) use the smallest tile that holds every query head of a KV
    head, so no rows are wasted on absent query tokens; longer queries use 64-row tiles
    (32 for heads over 128 and for float32). Keys per iteration: 64 for 16-bit heads up
    to 128; 32 (16 in decode tiles) beyond; 16 for float32 (an exact, non-tensor-core
    ``tl.dot``). Warps: 8 for float32 heads from 128, 16-bit heads of 256 and tiles of
    ``block_m * head_size >= 8192``, else 4; except that on ``sm >= 90`` a tile of exactly
    8192 (the 64-row 16-bit d=128 prefill tile) takes 4: it ran 1.41x faster than with 8 on
    a prefill and 1.28x on a mixed step (H200, triton 3.6, ``tests/gpu/tile_sweep.py``,
    docs/performance.md), and on sm_80 it would spill (40 B of stack). ``sm``: the GPU's
    compute capability as ``10 * major + minor`` (``None``: 80's choice). These sizes compile
    without register spills for sm_80 and sm_90 (``python -m attnplug.backends.triton.aot_check
    --full``; a quick subset runs in ``tests/backends/triton/test_gpu_compile.py``).

    Interpreter (``interpreter=True``; default: whatever mode the process runs in): the
    cost is per operation, not per element, so queries longer than a decode tile use
    128-row tiles and every iteration takes 128 keys: fewer programs and iterations, the
    same results.
    """
    if interpreter is None:
        interpreter = interpreting()
    group_rows = _next_pow2(max(num_queries_per_kv, 1))
    small = max(16, group_rows)
    fp32 = dtype == torch.float32
    if max_query_len <= small // num_queries_per_kv:
        block_m = small
    elif interpreter:
        block_m = max(128, group_rows)
    else:
        block_m = max(32 if (fp32 or head_size > 128) else 64, group_rows)
    if interpreter:
        tile_n = 128
    elif fp32:
        tile_n = 16
    elif head_size <= 128:
        tile_n = 64
    else:
        tile_n = 32 if block_m >= 32 else 16
    wide = block_m * head_size > 8192 or (block_m * head_size == 8192 and (sm is None or sm < 90))
    num_warps = 8 if head_size >= (128 if fp32 else 256) or wide else 4
    return TileConfig(block_m, block_m // num_queries_per_kv, tile_n, num_warps, num_stages=2)


def num_query_tiles(num_tokens: int, num_reqs: int, block_q: int) -> int:
    """Programs along grid axis 0: ``num_tokens // block_q + num_reqs`` (covers every
    request's ``cdiv(query_len, block_q)`` tiles; see ``attention_kernels``)."""
    return num_tokens // block_q + num_reqs


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    output: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, *, num_reqs: int, max_query_len: int, scale: float,
                    causal: bool = True, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, num_kv_splits: int = 1,
                    tiles: TileConfig | None = None, visited_tiles: torch.Tensor | None = None,
                    check_values: bool = True, lse: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a varlen batch over a paged KV cache (GQA/MQA, causal bottom-right).

    Query ``j`` of request ``i`` sits at position ``seq_lens[i] - query_len_i + j`` and
    sees key ``k`` iff ``k <= position`` (causal) and ``position - W < k`` (window ``W``).

    Args:
        query: ``[num_tokens, num_heads, head_size]``, float32/float16/bfloat16; last dim
            contiguous. Rows past ``query_start_loc[num_reqs]`` are padding (ignored).
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, query's dtype and
            device (e.g. ``kv_cache[:, 0]``: any strides with a contiguous last dim).
        value_cache: same as ``key_cache`` (e.g. ``kv_cache[:, 1]``).
        output: ``[num_tokens, num_heads, head_size]``, same device; rows of real tokens
            are overwritten, padded rows are untouched.
        query_start_loc: ``[num_reqs + 1]``, ``torch.int32``, device; tokens.
        seq_lens: ``[num_reqs]``, ``torch.int32``, device; tokens of KV per request,
            ``>= query_len``.
        block_table: ``[num_reqs, >= cdiv(max_seq_len, block_size)]``, ``torch.int32``,
            device; kernel block ids, last dim contiguous.
        num_reqs: requests (Python int).
        max_query_len: longest query (Python int; picks the tile sizes only).
        scale: softmax scale applied to ``q . k``.
        causal: bottom-right aligned causal mask.
        sliding_window: ``W`` tokens, current included, or ``None``.
        logits_soft_cap: ``cap * tanh(logits / cap)`` after scaling, or ``None``.
        num_kv_splits: 1 for the unified single-launch path; ``> 1`` (a power of two)
            splits each request's visible keys into that many segments plus a reduce.
        tiles: tile sizes to use instead of :func:`choose_tiles`'s (tests run the GPU
            sizes in the interpreter with it).
        check_values: check the index values where they are checked (below); ``False``
            when the caller already did (``TritonAttentionImpl`` checks before its K/V
            write).
        visited_tiles, lse, sinks, alibi_slopes, k_scale, v_scale: the optional inputs, each
            ``None`` (the default: not used) or a tensor on ``query``'s device as the module
            docstring's "Optional inputs" gives its shape, dtype and meaning.

    Returns:
        ``output``.

    Raises:
        MetadataError: shapes, dtypes or parameters the kernels cannot take (a head size
            not a multiple of 16 or over 256, a window or soft-cap that is not positive,
            ``num_reqs`` beyond the metadata tensors, bfloat16 under the interpreter, whose
            bf16 ``tl.dot`` is wrong); and, where values are checked
            (:mod:`~attnplug.backends.common.value_checks`: CPU tensors always, a GPU with
            ``ATTNPLUG_VALIDATE=1``), a ``query_start_loc``/``seq_lens``/block table that
            disagree with each other or point outside the cache. Nothing is written then.

    Numerics: fp32 logits, base-2 online softmax and accumulator; probabilities are cast
    to the cache dtype for the ``P @ V`` product. Does not synchronise with the host;
    graph-capturable for a fixed ``(query.shape[0], num_reqs, num_kv_splits)``.
    """
    num_tokens, head_size = query.shape[0], query.shape[-1]
    _check(query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table, num_reqs, num_kv_splits,
           sliding_window, logits_soft_cap)
    _check_optional_tensors(query, num_kv_splits, lse, sinks, alibi_slopes)
    if num_reqs == 0 or num_tokens == 0:
        return output
    if check_values and values_checked(query.device):
        check_batch(query_start_loc, seq_lens, block_table, num_reqs=num_reqs, num_tokens=num_tokens,
                    num_blocks=key_cache.shape[0], block_size=key_cache.shape[1], where="paged_attention")
    lowered = lower_arguments(query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table,
                              num_reqs=num_reqs, max_query_len=max_query_len, scale=scale, causal=causal,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                              num_kv_splits=num_kv_splits, tiles=tiles, visited_tiles=visited_tiles, lse=lse,
                              sinks=sinks, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes)
    kernels = kernel_module("attention_kernels")
    launch(kernels, "paged_attention_kernel", lowered.grid, *lowered.args, **lowered.constants)
    if num_kv_splits > 1:
        _reduce_segments(kernels, output, lowered.partials, query_start_loc, num_reqs, head_size,
                         lowered.head_size_padded, num_kv_splits)
    return output


@dataclass(frozen=True)
class KernelLaunch:
    """``paged_attention_kernel``'s launch, lowered from :func:`paged_attention`'s arguments.

    Attributes:
        grid: ``(num_query_tiles(num_tokens, num_reqs, block_q), num_kv_heads, num_kv_splits)``.
        args: the kernel's positional arguments in its signature's order: the 16 tensors
            (absent optional ones stand in as a tensor the kernel never reads: ``seq_lens``
            or ``part_max``), ``num_reqs``, ``scale``, the soft-cap (0.0 without), then the
            strides (query, output, key and value caches, block table, ``lse``; 0 without).
        constants: the kernel's ``tl.constexpr`` keyword arguments (shapes, tile sizes,
            feature flags) and the launch options ``num_warps`` / ``num_stages``.
        partials: the split-KV partials ``(acc [num_tokens, num_heads, num_kv_splits,
            head_size_padded], max, sum [num_tokens, num_heads, num_kv_splits])`` fp32, or
            ``output`` three times with one segment (never touched then).
        head_size_padded: the next power of two ``>= max(head_size, 16)``.
    """

    grid: tuple[int, int, int]
    args: tuple
    constants: dict
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    head_size_padded: int


def lower_arguments(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                    num_reqs: int, max_query_len: int, scale: float, causal: bool, sliding_window: int | None,
                    logits_soft_cap: float | None, num_kv_splits: int, tiles: TileConfig | None,
                    visited_tiles: torch.Tensor | None, lse: torch.Tensor | None, sinks: torch.Tensor | None,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    alibi_slopes: torch.Tensor | None) -> KernelLaunch:
    """The grid, arguments and constants of ``paged_attention_kernel`` for
    :func:`paged_attention`'s (already checked) arguments, same names and meanings; allocates
    the split-KV partials (``num_kv_splits > 1``) and an fp8 cache's per-head descales on
    ``query``'s device. Launches nothing, checks nothing."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    cfg = tiles or choose_tiles(max_query_len, group, head_size, query.dtype,
                                sm=compute_capability(query.device))
    padded = max(16, _next_pow2(head_size))
    grid = (num_query_tiles(num_tokens, num_reqs, cfg.block_q), num_kv_heads, num_kv_splits)
    partials = _segment_partials(output, num_kv_splits, padded)
    part_max = partials[1]
    kv_fp8 = is_quantized(key_cache.dtype)
    k_desc, v_desc = _kv_descales(k_scale, v_scale, num_kv_heads, query.device) if kv_fp8 else (seq_lens, seq_lens)
    tensors = (query, key_cache, value_cache, output, *partials, query_start_loc, seq_lens, block_table,
               visited_tiles if visited_tiles is not None else seq_lens, lse if lse is not None else part_max,
               sinks if sinks is not None else part_max, alibi_slopes if alibi_slopes is not None else part_max,
               k_desc, v_desc)
    scalars = (num_reqs, float(scale), float(logits_soft_cap) if logits_soft_cap is not None else 0.0)
    strides = (query.stride(0), query.stride(1), output.stride(0), output.stride(1),
               key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
               value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
               block_table.stride(0), *(lse.stride()[:2] if lse is not None else (0, 0)))
    constants = dict(
        NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_SIZE_PADDED=padded,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q, TILE_N=cfg.tile_n,
        CAUSAL=bool(causal), SLIDING_WINDOW=int(sliding_window or 0),
        USE_SOFT_CAP=logits_soft_cap is not None, NUM_SEGMENTS=num_kv_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        RECORD_VISITED=visited_tiles is not None,
        KV_SAME_STRIDES=key_cache.stride()[:2] == value_cache.stride()[:2], STORE_LSE=lse is not None,
        USE_SINKS=sinks is not None, USE_ALIBI=alibi_slopes is not None, KV_FP8=kv_fp8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return KernelLaunch(grid, tensors + scalars + strides, constants, partials, padded)


def _check_optional_tensors(query: torch.Tensor, num_kv_splits: int, lse: torch.Tensor | None,
                            sinks: torch.Tensor | None, alibi_slopes: torch.Tensor | None) -> None:
    """:func:`paged_attention`'s checks of ``lse``, ``sinks`` and ``alibi_slopes`` where given."""
    if lse is not None:
        _check_lse(lse, query, num_kv_splits)
    if sinks is not None:
        _check_sinks(sinks, query)
    if alibi_slopes is not None:
        _check_sinks(alibi_slopes, query, "alibi_slopes")


def _segment_partials(output: torch.Tensor, num_kv_splits: int,
                      padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-KV partials, fp32 on ``output``'s device: accumulators ``[num_tokens,
    num_heads, num_kv_splits, padded]``, running maxima and sums ``[num_tokens, num_heads,
    num_kv_splits]``; with one segment ``output`` three times (the kernel never touches them
    when ``NUM_SEGMENTS == 1``)."""
    if num_kv_splits == 1:
        return output, output, output
    num_tokens, num_heads = output.shape[:2]
    part_acc = torch.empty(num_tokens, num_heads, num_kv_splits, padded, dtype=torch.float32, device=output.device)
    part_max = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=output.device)
    return part_acc, part_max, torch.empty_like(part_max)


def _kv_descales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, num_kv_heads: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 cache's K and V descales as float32 ``[num_kv_heads]`` on ``device``
    (``core/kv_quant.per_head_scales``)."""
    return per_head_scales(k_scale, num_kv_heads, device), per_head_scales(v_scale, num_kv_heads, device)


def _reduce_segments(kernels, output: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     query_start_loc: torch.Tensor, num_reqs: int, head_size: int, padded: int,
                     num_kv_splits: int) -> None:
    """The split-KV second launch: ``reduce_segments_kernel`` combines the segments'
    ``partials`` (see :func:`_segment_partials`) into ``output``, ``heads_per_program`` heads
    per program (at most :data:`REDUCE_ELEMENTS_PER_PROGRAM` fp32 elements)."""
    num_tokens, num_heads = output.shape[:2]
    heads_per_program = max(1, min(_next_pow2(num_heads), REDUCE_ELEMENTS_PER_PROGRAM // (padded * num_kv_splits)))
    launch(kernels, "reduce_segments_kernel", (num_tokens, -(-num_heads // heads_per_program)),
           output, *partials, query_start_loc, num_reqs, num_heads,
           output.stride(0), output.stride(1),
           HEAD_SIZE=head_size, HEAD_SIZE_PADDED=padded, NUM_SEGMENTS=num_kv_splits,
           HEADS_PER_PROGRAM=heads_per_program, num_warps=4)


def _check(query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table, num_reqs: int,
           num_kv_splits: int, sliding_window: int | None, logits_soft_cap: float | None) -> None:
    problems = []
    if query.dim() != 3 or key_cache.dim() != 4:
        raise MetadataError(f"paged_attention: query {tuple(query.shape)} must be [num_tokens, num_heads, "
                            f"head_size] and key_cache {tuple(key_cache.shape)} [num_blocks, block_size, "
                            "num_kv_heads, head_size]")
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size or value_cache.shape != key_cache.shape:
        problems.append(f"key_cache {tuple(key_cache.shape)} / value_cache {tuple(value_cache.shape)} do not "
                        f"match head_size {head_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        problems.append(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_size % 16 or not 0 < head_size <= MAX_HEAD_SIZE:
        problems.append(f"head_size {head_size} is not a multiple of 16 in [16, {MAX_HEAD_SIZE}]")
    if query.dtype == torch.bfloat16 and interpreting():
        problems.append("bfloat16 under TRITON_INTERPRET=1: the interpreter's bf16 tl.dot gives wrong results; "
                        "use float16 or float32 on the CPU (bfloat16 runs on a GPU)")
    if num_reqs < 0 or query_start_loc.shape[0] < num_reqs + 1 or seq_lens.shape[0] < num_reqs \
            or block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        problems.append(f"num_reqs {num_reqs} needs query_start_loc [>= num_reqs + 1], seq_lens [>= num_reqs] and "
                        f"block_table [>= num_reqs, blocks]; got [{query_start_loc.shape[0]}], [{seq_lens.shape[0]}], "
                        f"{tuple(block_table.shape)}")
    if query_start_loc.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        problems.append(f"query_start_loc and seq_lens must be int32, got {query_start_loc.dtype} and {seq_lens.dtype}")
    if sliding_window is not None and sliding_window <= 0:
        problems.append(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        problems.append(f"logits_soft_cap must be positive or None, got {logits_soft_cap}")
    devices = {t.device for t in (query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table)}
    if len(devices) != 1:
        problems.append(f"tensors on several devices ({sorted(map(str, devices))})")
    if output.shape != query.shape:
        problems.append(f"output {tuple(output.shape)} must match query {tuple(query.shape)}")
    if value_cache.dtype != key_cache.dtype or (key_cache.dtype != query.dtype and not is_quantized(key_cache.dtype)):
        problems.append(f"cache dtype {key_cache.dtype} differs from query dtype {query.dtype}")
    for name, t in (("query", query), ("output", output), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("block_table", block_table)):
        if t.numel() and t.stride(-1) != 1:
            problems.append(f"{name}'s last dim must be contiguous")
    if block_table.dtype != torch.int32:
        problems.append(f"block_table must be int32, got {block_table.dtype}")
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        problems.append(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")
    if problems:
        raise MetadataError("paged_attention: " + "; ".join(problems) + ".")


def _check_lse(lse: torch.Tensor, query: torch.Tensor, num_kv_splits: int) -> None:
    if num_kv_splits != 1 or lse.dtype != torch.float32 or lse.device != query.device or lse.dim() != 2 \
            or lse.shape[0] < query.shape[0] or lse.shape[1] != query.shape[1]:
        raise MetadataError(
            f"paged_attention: lse must be [>= {query.shape[0]}, {query.shape[1]}] float32 on {query.device} with "
            f"num_kv_splits == 1; got {tuple(lse.shape)} {lse.dtype} on {lse.device}, num_kv_splits={num_kv_splits}")


def _check_sinks(sinks: torch.Tensor, query: torch.Tensor, name: str = "sinks") -> None:
    if sinks.dtype != torch.float32 or sinks.device != query.device or tuple(sinks.shape) != (query.shape[1],):
        raise MetadataError(
            f"paged_attention: {name} must be [{query.shape[1]}] float32 on {query.device} (one value per "
            f"query head); got {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")
