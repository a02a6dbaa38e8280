"""CUDA graphs over the flash_attn and flashinfer impls (real kernels; needs CUDA and the
extras): capture one padded step, then replay twice with NEW inputs copied into the same
buffers and new metadata built into the builder's persistent buffers — each replay equals
an eager forward of the same step, and writes the same KV cache."""

from __future__ import annotations

import pytest
import torch

from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.execute.cudagraph import PaddedMetadata

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]

H, H_KV, D, NUM_BLOCKS = 8, 2, 128, 48
DTYPE = torch.float16


def _backend(name: str):
    from attnplug.plugins import get_backend

    cls = get_backend(name)
    ok, why = cls.is_available()
    if not ok:
        pytest.skip(f"requires {name}: {why}")
    return cls


def _step(seed: int, block_size: int, requests: list[tuple[int, int]], P: int, R_pad: int, padded: PaddedMetadata):
    """A padded step: per request (num_computed, num_scheduled), distinct random blocks."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS - 1, generator=g) + 1
    width = max(-(-(c + s) // block_size) for c, s in requests)
    table = [perm[i * width:(i + 1) * width].tolist() for i in range(len(requests))]
    cm = CommonAttentionMetadata.from_lengths([c for c, _ in requests], [s for _, s in requests], table, block_size,
                                              device="cuda")
    Q = cm.num_actual_tokens
    cm = cm.replace(slot_mapping=torch.cat([cm.slot_mapping, torch.full((P - Q,), PAD_SLOT_ID, device="cuda")]))
    cm = padded.pad([cm], R_pad)[0]
    q = torch.randn(P, H, D, generator=g).to("cuda", DTYPE)
    k = torch.randn(P, H_KV, D, generator=g).to("cuda", DTYPE)
    v = torch.randn(P, H_KV, D, generator=g).to("cuda", DTYPE)
    return cm, q, k, v


SHAPES = {
    # kind: (P, R_pad, three steps of per-request (num_computed, num_scheduled))
    "decode": (4, 4, [[(300, 1), (17, 1), (511, 1)], [(40, 1), (700, 1), (2, 1)], [(1, 1), (129, 1), (64, 1)]]),
    "mixed": (16, 8, [[(300, 1), (0, 9), (20, 5)], [(90, 1), (33, 12), (5, 1)], [(0, 10), (2, 1), (7, 1)]]),
}


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("name", ["flash_attn", "flashinfer"])
def test_capture_then_replay_twice_with_new_inputs_equals_eager(name, kind):
    backend = _backend(name)
    block_size = backend.get_supported_kernel_block_size(256)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=H_KV, head_size=D, dtype=DTYPE)
    builder = backend.get_builder_cls()(spec, ["l0"], BuilderConfig(8, 64, 4 * 256), "cuda")
    support = type(builder).get_cudagraph_support(spec)
    if kind == "mixed" and support < AttentionCGSupport.ALWAYS:
        pytest.skip(f"{name} declares {support.name}: only uniform decode batches are captured")
    impl = backend.get_impl_cls()(H, D, D ** -0.5, H_KV)
    P, R_pad, steps = SHAPES[kind]
    padded = PaddedMetadata(8, "cuda")
    cache = torch.randn(backend.get_kv_cache_shape(NUM_BLOCKS, block_size, H_KV, D), device="cuda").to(DTYPE)
    cm, q, k, v = _step(0, block_size, steps[0], P, R_pad, padded)
    sq, sk, sv, sout = q.clone(), k.clone(), v.clone(), torch.zeros_like(q)
    md = builder.build_for_cudagraph_capture(cm)
    impl.forward(None, sq, sk, sv, cache, md, sout)  # warm-up (lazy initialisation outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, sq, sk, sv, cache, md, sout)
    for seed, requests in enumerate(steps[1:], start=1):
        cm, q, k, v = _step(seed, block_size, requests, P, R_pad, padded)
        new_md = builder.build_for_cudagraph_capture(cm)  # same persistent buffers, new contents
        for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            if hasattr(md, field):
                assert getattr(new_md, field).data_ptr() == getattr(md, field).data_ptr(), field
        eager_cache, eager_out = cache.clone(), torch.zeros_like(q)
        impl.forward(None, q, k, v, eager_cache, new_md, eager_out)
        sq.copy_(q), sk.copy_(k), sv.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        Q = cm.num_actual_tokens
        torch.testing.assert_close(sout[:Q], eager_out[:Q], atol=2e-3, rtol=2e-3)
        assert torch.equal(cache, eager_cache)
