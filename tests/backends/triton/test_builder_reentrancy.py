"""Builder re-entrancy: N ``build`` calls first, then the N forwards, give exactly what
build-then-forward step by step gives, for every attention builder that runs on a CPU
(torch_native, triton in the interpreter, the FlashAttention 3 and FlashInfer builders over
their emulators). A builder whose metadata points into state the next ``build`` overwrites
(a persistent buffer, a shared plan) fails here: FA3's scheduler metadata did (an eager
build now keeps ``get_scheduler_metadata``'s own tensor; only graph builds copy it into the
persistent buffer); FlashInfer's plans did (one decode and one prefill wrapper re-planned
by every build; now each eager build plans wrappers no live metadata holds). With attention
sinks on, where declared. The conformance suite runs the same check on any backend
(``test_builder_is_reentrant``)."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.emulators import FlashAttn3EmulatedBackend, FlashInferEmulatedBackend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.triton import TritonBackend
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata

H, HKV, D, B = 4, 2, 16, 16
CFG = BuilderConfig(max_num_reqs=4, max_num_batched_tokens=64, max_model_len=128)
STEPS = [  # (num_computed_tokens, num_scheduled_tokens) per request, decodes first (reorder_batch_threshold)
    [(20, 1), (0, 9), (5, 6)],
    [(33, 1), (14, 1)],
    [(40, 1), (2, 1), (0, 3), (17, 8)],
]


def _inputs(step: list[tuple[int, int]], seed: int):
    g = torch.Generator().manual_seed(seed)
    table = [[1 + 4 * i + b for b in range(4)] for i in range(len(step))]
    cm = CommonAttentionMetadata.from_lengths([c for c, _ in step], [s for _, s in step], table, block_size=B)
    kv = torch.randn(1 + 4 * len(step), 2, B, HKV, D, generator=g)
    q, k, v = (torch.randn(sum(s for _, s in step), h, D, generator=g) for h in (H, HKV, HKV))
    return cm, kv, q, k, v


@pytest.mark.parametrize("backend", [TorchNativeBackend, TritonBackend, FlashAttn3EmulatedBackend,
                                     FlashInferEmulatedBackend], ids=lambda b: b.get_name())
def test_n_builds_then_n_forwards_equal_sequential(backend):
    sinks = {"sinks": torch.tensor([0.5, 2.0, -1.0, 1.0])} if backend.supports_sink() else {}
    impl = backend.get_impl_cls()(H, D, D ** -0.5, HKV, **sinks)  # before the builds (FlashInfer plans for it)
    spec = FullAttentionSpec(block_size=B, num_kv_heads=HKV, head_size=D)
    builder = backend.get_builder_cls()(spec, ["l0"], CFG, "cpu")
    inputs = [_inputs(step, seed) for seed, step in enumerate(STEPS)]

    def forward(md, cm, kv, q, k, v):
        cache = torch.empty(backend.get_kv_cache_shape(kv.shape[0], B, HKV, D))  # the backend's layout
        key_cache, value_cache = backend.split_kv_cache(cache)
        key_cache.copy_(kv[:, 0])
        value_cache.copy_(kv[:, 1])
        return impl.forward(None, q, k, v, cache, md, torch.zeros_like(q))

    sequential = [forward(builder.build(0, x[0]), *x) for x in inputs]
    built = [builder.build(0, x[0]) for x in inputs]
    for i, (md, x) in enumerate(zip(built, inputs)):
        assert torch.equal(forward(md, *x), sequential[i]), f"step {i}: metadata built before the later builds differs"
