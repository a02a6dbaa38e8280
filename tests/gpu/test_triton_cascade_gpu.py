"""Cascade attention on the triton backend compiled on a CUDA GPU (marker ``gpu``; skipped
without CUDA): eight requests sharing a 512-token prefix (decodes and chunked prefills
mixed), prefix pass + suffix pass + merge equal to the one-pass kernel and to a float32
torch_native reference, in float16 and bfloat16, with ``forward`` and the cascade build
under ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronisation).

The same checks at tiny sizes run in the interpreter: ``tests/backends/triton/test_cascade_triton.py``.
"""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.triton import TritonBackend
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]

DEV = "cuda"
H, HKV, D, B, PREFIX = 16, 4, 128, 16, 512
CFG = BuilderConfig(max_num_reqs=8, max_num_batched_tokens=256, max_model_len=1024)


@pytest.fixture(autouse=True)
def compiled_mode():
    from attnplug.backends.triton.runtime import interpreting

    if interpreting():
        pytest.skip("this process runs Triton in the interpreter (TRITON_INTERPRET=1); GPU tests need compiled kernels")


def _step(dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    own_ctx = [0, 3, 17, 40, 1, 64, 9, 100]
    scheduled = [1, 1, 1, 1, 7, 30, 1, 64]
    computed = [PREFIX + c for c in own_ctx]
    shared = list(range(1, PREFIX // B + 1))
    nxt, table = len(shared) + 1, []
    for c, s in zip(computed, scheduled):
        own = -(-(c + s) // B) - len(shared)
        table.append(shared + list(range(nxt, nxt + own)))
        nxt += own
    width = max(map(len, table))
    table = [row + [0] * (width - len(row)) for row in table]
    cm = CommonAttentionMetadata.from_lengths(computed, scheduled, table, block_size=B, device=DEV)
    kv = torch.randn(nxt, 2, B, HKV, D, device=DEV, generator=g).to(dtype)
    T = sum(scheduled)
    q, k, v = (torch.randn(T, h, D, device=DEV, generator=g).to(dtype) for h in (H, HKV, HKV))
    return cm, kv, q, k, v


def _attend(backend, cm, kv, q, k, v, prefix, sync_check=False):
    spec = FullAttentionSpec(block_size=B, num_kv_heads=HKV, head_size=D)
    builder = backend.get_builder_cls()(spec, ["l0"], CFG, DEV)
    impl = backend.get_impl_cls()(H, D, D ** -0.5, HKV, logits_soft_cap=30.0)
    cache, out = kv.clone(), torch.zeros_like(q)
    torch.cuda.synchronize()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        md = builder.build(prefix, cm)
        impl.forward(None, q, k, v, cache, md, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out, md


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"])
def test_cascade_equals_one_pass_and_torch_native_on_cuda(dtype, tol, monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)  # value checks synchronise by design
    cm, kv, q, k, v = _step(dtype)
    cascade, md = _attend(TritonBackend, cm, kv, q, k, v, PREFIX, sync_check=True)
    assert md.cascade is not None and md.cascade.common_prefix_len == PREFIX
    one_pass, md0 = _attend(TritonBackend, cm, kv, q, k, v, 0)
    assert md0.cascade is None
    reference, _ = _attend(TorchNativeBackend, cm, kv.float(), q.float(), k.float(), v.float(), 0)
    torch.testing.assert_close(cascade.float(), reference, atol=tol, rtol=tol)
    torch.testing.assert_close(cascade.float(), one_pass.float(), atol=tol, rtol=tol)
