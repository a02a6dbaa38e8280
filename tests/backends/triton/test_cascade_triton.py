"""Cascade attention on the Triton backend (interpreter, fp32/fp16): the kernel's natural-log
LSE, the builder's cascade fields, prefix pass + suffix pass + merge equal to the one-pass
kernel and to torch_native, sliding-window groups never cascade, and the runner with the
triton backend gives the same tokens and logits with cascade on and off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.triton import TritonBackend, TritonMetadataBuilder, paged_attention
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata

sys.path.insert(0, str(Path(__file__).parents[2] / "runner" / "execute"))
from shared_prefix_cascade import SharedPrefixRun, assert_cascade_on_equals_off  # noqa: E402

H, HKV, D, B = 4, 2, 32, 16
CFG = BuilderConfig(max_num_reqs=4, max_num_batched_tokens=64, max_model_len=128)


def test_the_kernel_stores_the_natural_log_sum_exp(paged_batch):
    batch = paged_batch([(20, 3), (0, 9)], num_heads=H, num_kv_heads=HKV, head_size=D, block_size=B)
    lse = torch.full((batch.query.shape[0], H), 7.0)
    batch.run(lse=lse, logits_soft_cap=5.0, tiles=batch.tiles(interpreter=True))
    for i, (a, b) in enumerate(zip(batch.query_start_loc[:-1].tolist(), batch.query_start_loc[1:].tolist())):
        n = int(batch.seq_lens[i])
        k = batch.keys[i].double().repeat_interleave(H // HKV, 1)
        s = torch.einsum("thd,nhd->thn", batch.query[a:b].double(), k) * batch.scale
        s = 5.0 * torch.tanh(s / 5.0)
        pos = torch.arange(n - (b - a), n)[:, None, None]
        s = s.masked_fill(torch.arange(n)[None, None] > pos, float("-inf"))
        torch.testing.assert_close(lse[a:b].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def _step(dtype, shared_blocks=3, seed=0):
    """Three requests sharing ``shared_blocks`` blocks (ids 1..), each with its own blocks
    after, a poisoned cache with the step's K/V not yet written."""
    g = torch.Generator().manual_seed(seed)
    computed, scheduled = [shared_blocks * B + 5, shared_blocks * B + 17, shared_blocks * B], [1, 6, 9]
    shared = list(range(1, shared_blocks + 1))
    nxt, table = shared_blocks + 1, []
    for c, s in zip(computed, scheduled):
        own = -(-(c + s) // B) - shared_blocks
        table.append(shared + list(range(nxt, nxt + own)) + [0] * (6 - shared_blocks - own))
        nxt += own
    cm = CommonAttentionMetadata.from_lengths(computed, scheduled, table, block_size=B)
    kv = torch.randn(nxt + 1, 2, B, HKV, D, generator=g).to(dtype)
    kv[0] = 1000.0  # the null block: never read
    T = sum(scheduled)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (H, HKV, HKV))
    return cm, kv, q, k, v


def _attend(backend, cm, kv, q, k, v, prefix, window=None, cap=None):
    spec = FullAttentionSpec(block_size=B, num_kv_heads=HKV, head_size=D) if window is None else \
        SlidingWindowSpec(block_size=B, num_kv_heads=HKV, head_size=D, sliding_window=window)
    md = backend.get_builder_cls()(spec, ["l0"], CFG, "cpu").build(prefix, cm)
    impl = backend.get_impl_cls()(H, D, D ** -0.5, HKV, sliding_window=window, logits_soft_cap=cap)
    cache = kv.clone()
    return impl.forward(None, q, k, v, cache, md, torch.zeros_like(q)), md, cache


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
def test_cascade_equals_one_pass_and_torch_native(dtype, tol):
    cm, kv, q, k, v = _step(dtype)
    one_pass, md0, cache0 = _attend(TritonBackend, cm, kv, q, k, v, 0, cap=20.0)
    assert md0.cascade is None
    cascade, md, cache = _attend(TritonBackend, cm, kv, q, k, v, 1000, cap=20.0)  # clamped to min computed = 48
    assert md.cascade is not None and md.cascade.common_prefix_len == 3 * B
    assert md.cascade.prefix_block_table.tolist() == [[1, 2, 3]]
    assert md.cascade.suffix_seq_lens.tolist() == (md.seq_lens - 3 * B).tolist()
    assert torch.equal(cache, cache0), "the K/V write is the same"
    reference, _, _ = _attend(TorchNativeBackend, cm, kv.float(), q.float(), k.float(), v.float(), 0, cap=20.0)
    torch.testing.assert_close(cascade.float(), one_pass.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(cascade.float(), reference, atol=tol, rtol=tol)
    shorter, md2, _ = _attend(TritonBackend, cm, kv, q, k, v, 20)  # rounded down to one block
    assert md2.cascade.common_prefix_len == B
    torch.testing.assert_close(shorter.float(), _attend(TritonBackend, cm, kv, q, k, v, 0)[0].float(),
                               atol=tol, rtol=tol)


def test_sliding_window_groups_never_cascade():
    cm, kv, q, k, v = _step(torch.float32)
    assert TritonMetadataBuilder.supports_cascade
    out, md, _ = _attend(TritonBackend, cm, kv, q, k, v, 3 * B, window=24)
    assert md.cascade is None
    torch.testing.assert_close(out, _attend(TorchNativeBackend, cm, kv, q, k, v, 0, window=24)[0],
                               atol=2e-5, rtol=2e-5)


RUN = SharedPrefixRun(num_layers=1, max_position_embeddings=128, num_blocks=24, max_num_reqs=4, max_model_len=64,
                      max_tokens=2, num_sharing=2)


@pytest.mark.parametrize("threshold", [16, 64], ids=["prefix-above-threshold", "prefix-below-threshold"])
def test_runner_cascade_on_equals_off_with_triton(threshold):
    assert_cascade_on_equals_off(RUN, TritonBackend, threshold)


def test_update_block_table_recuts_the_cascade_passes_from_the_other_groups_table():
    cm, *_ = _step(torch.float32)
    b = TritonMetadataBuilder(FullAttentionSpec(block_size=B, num_kv_heads=HKV, head_size=D), ["l0"], CFG, "cpu")
    md = b.build(2 * B, cm)
    other = cm.block_table_tensor + 20
    md2 = b.update_block_table(md, other, cm.slot_mapping + 20 * B)
    assert md2.cascade.common_prefix_len == 2 * B
    assert md2.cascade.prefix_block_table.tolist() == [[21, 22]]
    assert torch.equal(md2.cascade.suffix_block_table, other[:, 2:])
    assert md.cascade.prefix_block_table.tolist() == [[1, 2]], "the given metadata is not mutated"


def test_a_row_that_sees_no_key_gets_minus_infinity(paged_batch):
    batch = paged_batch([(4, 2), (8, 3)], num_heads=H, num_kv_heads=HKV, head_size=D, block_size=B)
    lse = torch.zeros(batch.query.shape[0], H)
    empty = batch.seq_lens.clone()
    empty[0] = 0  # request 0 sees no key (non-causal, no K/V): its rows are empty
    paged_attention(batch.query, batch.kv_cache[:, 0], batch.kv_cache[:, 1], torch.zeros_like(batch.query),
                    batch.query_start_loc, empty, batch.block_table, num_reqs=2, max_query_len=3, scale=batch.scale,
                    causal=False, lse=lse, check_values=False)
    assert torch.isneginf(lse[:2]).all() and torch.isfinite(lse[2:]).all()
    with pytest.raises(MetadataError, match="lse must be"):  # split-KV stores no LSE
        batch.run(lse=lse, num_kv_splits=2)
    with pytest.raises(MetadataError, match="lse must be"):
        batch.run(lse=lse.double())
