"""Checks of a whole attention backend, not of one case: builder re-entrancy and the declared
KV layout.

* **Re-entrancy** (``check_reentrant``; vllm#50945): one builder builds N steps before any of
  them runs (an asynchronous scheduler, a speculative step built ahead), then the N forwards
  run. Each must equal what a build right before its forward gives, bit for bit. A builder
  whose metadata points into state the next ``build`` overwrites (a persistent buffer, a plan
  kept in a kernel wrapper) fails, naming the step.
* **KV layout** (``check_kv_layout``): the backend's ``kv_cache_layout`` descriptor
  (``core/kv_layout.py``) must say what ``get_kv_cache_shape`` returns and what
  ``split_kv_cache`` views, since the conformance suite and the vLLM bridge read the
  descriptor instead of special cases; a mismatch names the field and the dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.contracts import AttentionBackend, BuilderConfig
from attnplug.core.kv_layout import DIMS
from attnplug.core.metadata import CommonAttentionMetadata

NUM_HEADS, NUM_KV_HEADS = 4, 2
BLOCKS_PER_REQUEST = 4


@dataclass(frozen=True)
class ReentrancyCase:
    """The re-entrancy case: steps of ``(num_computed_tokens, num_scheduled_tokens)`` per
    request, decodes first (every builder's ``reorder_batch_threshold`` holds), built one
    after another by one builder before any runs."""

    name: str
    steps: tuple[tuple[tuple[int, int], ...], ...]


REENTRANT_CASE = ReentrancyCase("reentrant_builds", (
    ((20, 1), (0, 9), (5, 6)),
    ((33, 1), (14, 1)),
    ((40, 1), (2, 1), (0, 3), (17, 8)),
))
"""Three steps: mixed, pure decode, mixed with more requests (a builder sizing anything by
the first step fails the third)."""


def _pick(backend_cls: type[AttentionBackend]) -> tuple[torch.dtype, int, int]:
    """``(dtype, head_size, block_size)`` the backend declares: float32 where it may (the
    comparison is bitwise either way), head size 16 or its smallest, block 16 or its smallest
    kernel block size."""
    dtypes = backend_cls.supported_dtypes
    dtype = torch.float32 if torch.float32 in dtypes else dtypes[0]
    heads = backend_cls.supported_head_sizes
    head = 16 if heads is None or 16 in heads else min(heads)
    blocks = backend_cls.supported_kernel_block_sizes
    block = 16 if blocks is None or 16 in blocks else min(blocks)
    return dtype, head, block


def check_reentrant(backend_cls: type[AttentionBackend], device: str,
                    case: ReentrancyCase = REENTRANT_CASE) -> list[str]:
    """N builds by one builder, then the N forwards, vs N (build, forward) pairs (module
    docstring). Attention sinks are on where the backend declares them. Returns problems
    (empty: re-entrant), each naming the case and the step."""
    dtype, D, B = _pick(backend_cls)
    H, HKV = NUM_HEADS, NUM_KV_HEADS
    sinks = ({"sinks": torch.tensor([0.5, 2.0, -1.0, 1.0], device=device)}
             if backend_cls.supports_sink() else {})
    impl = backend_cls.get_impl_cls()(H, D, D ** -0.5, HKV, **sinks)  # before any build (planned builders)
    spec = FullAttentionSpec(block_size=B, num_kv_heads=HKV, head_size=D, dtype=dtype)
    most = max(len(s) for s in case.steps)
    cfg = BuilderConfig(max_num_reqs=most, max_num_batched_tokens=max(sum(n for _, n in s) for s in case.steps),
                        max_model_len=BLOCKS_PER_REQUEST * B, dtype=dtype)
    builder = backend_cls.get_builder_cls()(spec, ["layer0"], cfg, device)

    def inputs(step, seed):
        g = torch.Generator().manual_seed(seed)
        table = [[1 + BLOCKS_PER_REQUEST * i + b for b in range(BLOCKS_PER_REQUEST)] for i in range(len(step))]
        cm = CommonAttentionMetadata.from_lengths([c for c, _ in step], [n for _, n in step], table, block_size=B,
                                                  device=device)
        num_blocks = 1 + BLOCKS_PER_REQUEST * len(step)
        kv = torch.randn(num_blocks, 2, B, HKV, D, generator=g).to(device=device, dtype=dtype)
        qkv = [torch.randn(sum(n for _, n in step), h, D, generator=g).to(device=device, dtype=dtype)
               for h in (H, HKV, HKV)]
        return cm, kv, qkv

    def forward(md, kv, qkv):
        cache = torch.zeros(backend_cls.get_kv_cache_shape(kv.shape[0], B, HKV, D), dtype=dtype, device=device)
        key_cache, value_cache = backend_cls.split_kv_cache(cache)
        key_cache.copy_(kv[:, 0])
        value_cache.copy_(kv[:, 1])
        q, k, v = qkv
        return impl.forward(None, q, k, v, cache, md, torch.zeros_like(q)).cpu()

    steps = [inputs(step, seed) for seed, step in enumerate(case.steps)]
    sequential = [forward(builder.build(0, cm), kv, qkv) for cm, kv, qkv in steps]
    built = [builder.build(0, cm) for cm, _, _ in steps]
    problems = []
    for i, (md, (_, kv, qkv)) in enumerate(zip(built, steps)):
        where = f"case {case.name!r}, step {i}: built before {len(steps) - 1 - i} later build(s) and run after them"
        try:
            late = forward(md, kv, qkv)
        except Exception as exc:  # e.g. a kernel refusing a plan made for another step
            problems.append(f"{where}, forward raised {type(exc).__name__}: {exc} (a build right before it "
                            "runs): the metadata points into state a later build() overwrote")
            continue
        if not torch.equal(late.nan_to_num(), sequential[i].nan_to_num()):
            diff = float((late.double() - sequential[i].double()).abs().nan_to_num(float("inf")).max())
            problems.append(
                f"{where}, the output differs from a build right before its forward (max |diff| {diff:.3g}): the "
                "metadata points into state a later build() overwrote (a persistent buffer, a plan kept in a "
                "kernel wrapper); give each build its own")
    return problems


def check_kv_layout(backend_cls: type[AttentionBackend]) -> list[str]:
    """The declared ``kv_cache_layout`` vs ``get_kv_cache_shape`` and ``split_kv_cache``.

    With distinct sizes per dimension (blocks 5, tokens 3, KV heads 2, head size 8 or the
    backend's smallest, K/V 2), the shape must be the descriptor's ``shape()``, and the two
    halves ``split_kv_cache`` returns must be the descriptor's ``split()`` of the same tensor
    (same values, every element); a problem names the field (``dims``) and where it differs.
    """
    layout = getattr(backend_cls, "kv_cache_layout", None)
    name = backend_cls.get_name()
    if layout is None:
        return [f"backend {name!r} declares no kv_cache_layout (core/kv_layout.KVCacheLayout)"]
    heads = backend_cls.supported_head_sizes
    blocks = backend_cls.supported_kernel_block_sizes
    D = 8 if heads is None or 8 in heads else min(heads)
    T = 3 if blocks is None or 3 in blocks else min(blocks)
    sizes = {"block": 5, "kv": 2, "token": T, "head": 2, "dim": D}
    shape = tuple(backend_cls.get_kv_cache_shape(sizes["block"], T, sizes["head"], D))
    declared = layout.shape(sizes["block"], T, sizes["head"], D)
    if shape != declared:
        named = [f"dimension {i}: get_kv_cache_shape gives {got}, kv_cache_layout.dims says {layout.dims[i]!r} "
                 f"({want})" for i, (got, want) in enumerate(zip(shape, declared)) if got != want]
        return [f"backend {name!r}: kv_cache_layout.dims {layout.dims} declares shape {declared} for "
                f"(num_blocks={sizes['block']}, block_size={T}, num_kv_heads={sizes['head']}, head_size={D}) "
                f"but get_kv_cache_shape returns {shape}" + ("; " + "; ".join(named) if named else "")]
    cache = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).view(shape)
    problems = []
    for half, got, want in zip("KV", backend_cls.split_kv_cache(cache), layout.split(cache)):
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
            problems.append(f"backend {name!r}: split_kv_cache's {half} half ({tuple(got.shape)}) is not the "
                            f"kv_cache_layout's (dims {layout.dims}: {tuple(want.shape)}, "
                            f"[num_blocks, block_size, num_kv_heads, head_size] in the order {DIMS})")
    return problems
