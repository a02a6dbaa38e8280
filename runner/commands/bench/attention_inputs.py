"""The batches of ``attnplug bench attention`` and what every backend is given for one.

:func:`trace_batches` builds the decode, prefill and mixed steps from a trace's request
lengths; :func:`dense_kv` and :func:`step_qkv` make the (seeded) cached K/V and the
step's q/k/v, the same logical inputs for every backend; :func:`backend_inputs` lays them
out for one backend (its own page size, cache layout, builder and impl). Timing them is
``runner/commands/bench/attention.py``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One step's shape: per request (num_computed_tokens, num_scheduled_tokens), decodes first."""

    name: str
    requests: list[tuple[int, int]]

    @property
    def num_tokens(self) -> int:
        return sum(s for _, s in self.requests)

    def visible_pairs(self) -> int:
        """Query-key pairs a causal kernel must compute: query j of a request with context c
        sees c + j + 1 keys."""
        return sum(s * c + s * (s + 1) // 2 for c, s in self.requests)

    def kv_tokens(self) -> int:
        """Tokens in the cache after the step: context plus new, over all requests."""
        return sum(c + s for c, s in self.requests)

    def context_tokens(self) -> int:
        """Tokens already cached before the step (read from the cache, not written)."""
        return sum(c for c, _ in self.requests)


def trace_batches(args) -> list[Batch]:
    """Decode / prefill / mixed batches from the trace's lengths (see the module docstring)."""
    from attnplug.runner.commands.traces import load_trace

    trace = load_trace(args.trace, 4000, max_model_len=args.max_model_len, skip_invalid=True)
    cap = args.max_model_len - 1
    mid = [min(r.prompt_len + r.output_len // 2, cap) for r in trace]
    prompts = [min(r.prompt_len, cap) for r in trace]
    out = []
    for n in args.decode_batch:
        out.append(Batch(f"decode B={n}", [(mid[i % len(mid)], 1) for i in range(n)]))
    reqs, left, i = [], args.prefill_tokens, 0
    while left > 0:
        take = min(prompts[i % len(prompts)], left)
        reqs.append((0, take))
        left -= take
        i += 1
    out.append(Batch(f"prefill {args.prefill_tokens} tok", reqs))
    decodes = [(mid[(i * 7) % len(mid)], 1) for i in range(args.mixed_decodes)]
    left, chunks, i = args.mixed_budget - len(decodes), [], 0
    while left > 0:
        p = prompts[(i * 13 + 5) % len(prompts)]
        done = p // 2 if i == 0 else 0  # one chunked-prefill continuation, then new prompts
        take = min(p - done, left)
        chunks.append((done, take))
        left -= take
        i += 1
    out.append(Batch(f"mixed {len(decodes)}d+{len(chunks)}p/{args.mixed_budget} tok", decodes + chunks))
    return [b for b in out if b.name.split()[0] in args.workload]


def dense_kv(batch: Batch, args, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's cached K and V, ``[kv_tokens, num_kv_heads, head_size]`` each, requests
    in order: the same logical cache for every backend, whatever its layout or page size."""
    g = torch.Generator(device=args.device).manual_seed(1)
    shape = (batch.kv_tokens(), args.num_kv_heads, args.head_size)
    return (torch.randn(shape, device=args.device, generator=g).to(dtype),
            torch.randn(shape, device=args.device, generator=g).to(dtype))


def step_qkv(batch: Batch, args, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's q ``[num_tokens, num_heads, head_size]`` and new k, v ``[num_tokens,
    num_kv_heads, head_size]``: the same for every backend (seeded)."""
    gen = torch.Generator(device=args.device).manual_seed(2)
    shapes = [(batch.num_tokens, h, args.head_size) for h in (args.num_heads, args.num_kv_heads, args.num_kv_heads)]
    q, k, v = (torch.randn(shape, device=args.device, generator=gen).to(dtype) for shape in shapes)
    return q, k, v


def backend_inputs(batch: Batch, backend, args, dtype, kv_dense):
    """Builder, metadata, impl, cache and q/k/v for ``backend`` (its own page size and layout)."""
    from attnplug.cache_groups.specs import FullAttentionSpec
    from attnplug.core.contracts import BuilderConfig
    from attnplug.core.metadata import CommonAttentionMetadata

    bs = args.block_size
    if backend.get_supported_kernel_block_size(bs) != bs:  # e.g. FlashAttention 2 pages by 256
        sizes = backend.supported_kernel_block_sizes or (bs,)
        bs = min(sizes, key=lambda s: (s < bs, abs(s - bs)))
    lens = torch.tensor([c + s for c, s in batch.requests], device=args.device)
    nblk = (lens + bs - 1) // bs
    width = -(-args.max_model_len // bs)
    perm_gen = torch.Generator(device=args.device).manual_seed(0)
    ids = torch.randperm(int(nblk.sum()), device=args.device, generator=perm_gen) + 1
    table = torch.zeros(len(batch.requests), width, dtype=torch.int64, device=args.device)
    cols = torch.arange(width, device=args.device)
    table[cols[None, :] < nblk[:, None]] = ids  # row-major fill: request i gets the next nblk[i] ids
    cm = CommonAttentionMetadata.from_lengths([c for c, _ in batch.requests], [s for _, s in batch.requests],
                                              table.cpu(), bs, device=args.device)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=args.num_kv_heads, head_size=args.head_size, dtype=dtype)
    cfg = BuilderConfig(max_num_reqs=len(batch.requests), max_num_batched_tokens=batch.num_tokens,
                        max_model_len=args.max_model_len)
    # the impl first: builders that plan per layer configuration (flashinfer, FA3's scheduler
    # metadata) read the live impls of their group at build time
    impl = backend.get_impl_cls()(args.num_heads, args.head_size, args.head_size ** -0.5, args.num_kv_heads,
                                  kv_cache_dtype=dtype)
    builder = backend.get_builder_cls()(spec, ["bench"], cfg, args.device)
    md = builder.build(0, cm)
    kv = torch.zeros(backend.get_kv_cache_shape(1 + int(nblk.sum()), bs, args.num_kv_heads, args.head_size),
                     dtype=dtype, device=args.device)
    req = torch.repeat_interleave(torch.arange(len(lens), device=args.device), lens)
    pos = torch.arange(int(lens.sum()), device=args.device) - (torch.cumsum(lens, 0) - lens)[req]
    blocks = table[req, pos // bs]
    for half, dense in zip(backend.split_kv_cache(kv), kv_dense):
        half[blocks, pos % bs] = dense
    return impl, md, kv, *step_qkv(batch, args, dtype), bs


__all__ = ["Batch", "backend_inputs", "dense_kv", "step_qkv", "trace_batches"]
