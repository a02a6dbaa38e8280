"""Attention sinks on the Triton kernels (interpreter, fp32) against a dense float64 reference
with the sink column, and against torch_native: one pass, a sliding window, split-KV
(the sink counted once over the segments) and a cascade step (prefix pass + suffix pass)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.triton import TritonBackend
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata

H, HKV, D, B = 4, 2, 16, 16
CFG = BuilderConfig(max_num_reqs=4, max_num_batched_tokens=64, max_model_len=128)
SINKS = torch.tensor([0.5, 3.0, -1.0, 2.0])


def _step(seed=0):
    """Three requests sharing 2 blocks (ids 1, 2), then their own blocks; K/V not yet written."""
    g = torch.Generator().manual_seed(seed)
    computed, scheduled = [2 * B + 5, 2 * B + 17, 2 * B], [1, 6, 9]
    nxt, table = 3, []
    for c, s in zip(computed, scheduled):
        own = -(-(c + s) // B) - 2
        table.append([1, 2] + list(range(nxt, nxt + own)) + [0] * (5 - own))
        nxt += own
    cm = CommonAttentionMetadata.from_lengths(computed, scheduled, table, block_size=B)
    kv = torch.randn(nxt + 1, 2, B, HKV, D, generator=g)
    q, k, v = (torch.randn(sum(scheduled), h, D, generator=g) for h in (H, HKV, HKV))
    return cm, kv, q, k, v, table, computed, scheduled


def _attend(backend, step, prefix=0, window=None, splits=None):
    cm, kv, q, k, v = step[:5]
    spec = FullAttentionSpec(block_size=B, num_kv_heads=HKV, head_size=D) if window is None else \
        SlidingWindowSpec(block_size=B, num_kv_heads=HKV, head_size=D, sliding_window=window)
    md = backend.get_builder_cls()(spec, ["l0"], CFG, "cpu").build(prefix, cm)
    if splits is not None:
        md = dataclasses.replace(md, num_kv_splits=splits)
    impl = backend.get_impl_cls()(H, D, D ** -0.5, HKV, sliding_window=window, sinks=SINKS.clone())
    return impl.forward(None, q, k, v, kv.clone(), md, torch.zeros_like(q)), md


def _dense(step, window=None):
    """float64: each query over its request's keys, the sink as one more logit with no value."""
    cm, kv, q, k, v, table, computed, scheduled = step
    out, row = torch.zeros(q.shape, dtype=torch.float64), 0
    for i, (c, s) in enumerate(zip(computed, scheduled)):
        blocks = torch.tensor(table[i])
        keys = kv[blocks, 0].reshape(-1, HKV, D)[:c].double()
        vals = kv[blocks, 1].reshape(-1, HKV, D)[:c].double()
        keys = torch.cat([keys, k[row:row + s].double()]).repeat_interleave(H // HKV, 1)
        vals = torch.cat([vals, v[row:row + s].double()]).repeat_interleave(H // HKV, 1)
        logits = torch.einsum("thd,nhd->htn", q[row:row + s].double(), keys) * D ** -0.5
        pos, key_pos = torch.arange(c, c + s)[:, None], torch.arange(c + s)[None, :]
        visible = key_pos <= pos if window is None else (key_pos <= pos) & (key_pos > pos - window)
        logits = logits.masked_fill(~visible[None], float("-inf"))
        sink = SINKS.double().view(H, 1, 1).expand(H, s, 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        out[row:row + s] = torch.einsum("htn,nhd->thd", probs, vals)
        row += s
    return out


@pytest.mark.parametrize("window, splits", [(None, None), (7, None), (None, 4)], ids=["full", "window", "split_kv"])
def test_triton_sinks_match_the_dense_reference(window, splits):
    step = _step()
    want = _dense(step, window)
    got, md = _attend(TritonBackend, step, window=window, splits=splits)
    assert md.cascade is None
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    native, _ = _attend(TorchNativeBackend, step, window=window)
    torch.testing.assert_close(native.double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", [TritonBackend, TorchNativeBackend], ids=["triton", "torch_native"])
def test_cascade_counts_the_sink_once(backend):
    step = _step(seed=1)
    got, md = _attend(backend, step, prefix=1000)  # clamped to the shared 2 blocks
    assert md.cascade is not None and md.cascade.common_prefix_len == 2 * B
    torch.testing.assert_close(got.double(), _dense(step), atol=2e-5, rtol=0)
