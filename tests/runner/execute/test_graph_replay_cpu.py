"""What a CUDA-graph replay needs from a builder, checked on the CPU with the emulated
flash_attn (FA2, FA3) and flashinfer backends.

A replay re-runs the captured kernels on the captured tensors: the metadata object built
at capture keeps its shapes, data pointers and host ints, and only the contents of the
builder's persistent buffers change. So, after capturing on one padded step, "replaying"
here means calling ``forward`` with the capture-time metadata object after
``build_for_cudagraph_capture`` of a NEW step (wider block table, other slots); it must
equal an eager ``forward`` with the new metadata, output and KV cache alike. The same
steps run for real on CUDA in ``tests/gpu/test_flash_cudagraph.py``.
"""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.emulators.backends import (
    FlashAttn2EmulatedBackend,
    FlashAttn3EmulatedBackend,
    FlashInferEmulatedBackend,
)
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.execute.cudagraph import PaddedMetadata

H, H_KV, D, NUM_BLOCKS, BLOCK = 4, 2, 32, 24, 256
DTYPE = torch.float16
BACKENDS = {"fa3": FlashAttn3EmulatedBackend, "fa2": FlashAttn2EmulatedBackend, "flashinfer": FlashInferEmulatedBackend}
# kind: (padded tokens, padded requests, three steps of per-request (num_computed, num_scheduled));
# the capture step needs 2 pages per request, the first replay 3 (a wider block table)
SHAPES = {
    "decode": (4, 4, [[(300, 1), (17, 1), (311, 1)], [(40, 1), (700, 1), (2, 1)], [(1, 1), (129, 1), (64, 1)]]),
    "mixed": (16, 8, [[(300, 1), (0, 9), (20, 5)], [(90, 1), (533, 12), (5, 1)], [(0, 10), (2, 1), (7, 1)]]),
}


def _step(seed, requests, P, R_pad, padded):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS - 1, generator=g) + 1
    width = max(-(-(c + s) // BLOCK) for c, s in requests)
    table = [perm[i * width:(i + 1) * width].tolist() for i in range(len(requests))]
    cm = CommonAttentionMetadata.from_lengths([c for c, _ in requests], [s for _, s in requests], table, BLOCK)
    pad = torch.full((P - cm.num_actual_tokens,), PAD_SLOT_ID)
    cm = padded.pad([cm.replace(slot_mapping=torch.cat([cm.slot_mapping, pad]))], R_pad)[0]
    q, k, v = (torch.randn(P, h, D, generator=g).to(DTYPE) for h in (H, H_KV, H_KV))
    return cm, q, k, v


SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H_KV, head_size=D, dtype=DTYPE)
# mixed steps only where the backend captures them (ALWAYS); the others capture uniform decodes
CASES = [(name, kind) for name in sorted(BACKENDS) for kind in SHAPES
         if kind == "decode" or BACKENDS[name].get_builder_cls().get_cudagraph_support(SPEC) == AttentionCGSupport.ALWAYS]


def test_the_cases_cover_mixed_steps():
    assert ("fa3", "mixed") in CASES and ("flashinfer", "mixed") not in CASES and ("fa2", "mixed") not in CASES


@pytest.mark.parametrize("name, kind", CASES)
def test_capture_time_metadata_replays_new_steps(name, kind):
    backend = BACKENDS[name]
    builder = backend.get_builder_cls()(SPEC, ["l0"], BuilderConfig(8, 64, 4 * BLOCK), "cpu")
    impl = backend.get_impl_cls()(H, D, D ** -0.5, H_KV)
    P, R_pad, steps = SHAPES[kind]
    padded = PaddedMetadata(8, "cpu")
    cache = torch.randn(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, H_KV, D)).to(DTYPE)
    cm, q, k, v = _step(0, steps[0], P, R_pad, padded)
    sq, sk, sv, sout = q.clone(), k.clone(), v.clone(), torch.zeros_like(q)  # the graph's static inputs
    captured = builder.build_for_cudagraph_capture(cm)
    impl.forward(None, sq, sk, sv, cache, captured, sout)
    for seed, requests in enumerate(steps[1:], start=1):
        cm, q, k, v = _step(seed, requests, P, R_pad, padded)
        new = builder.build_for_cudagraph_capture(cm)
        for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            if hasattr(captured, field):
                a, b = getattr(captured, field), getattr(new, field)
                assert (a.data_ptr(), a.shape) == (b.data_ptr(), b.shape), f"{field} moved or changed shape"
        eager_cache, eager_out = cache.clone(), torch.zeros_like(q)
        impl.forward(None, q, k, v, eager_cache, new, eager_out)
        sq.copy_(q), sk.copy_(k), sv.copy_(v)
        impl.forward(None, sq, sk, sv, cache, captured, sout)  # the replay
        n = cm.num_actual_tokens
        torch.testing.assert_close(sout[:n], eager_out[:n], atol=2e-3, rtol=2e-3)
        assert torch.equal(cache, eager_cache), "the replay wrote other K/V slots than the eager step"
