"""The flashinfer builder: vectorized page metadata, the decode/prefill split (and the
runner honouring ``reorder_batch_threshold = 1``), plans per distinct layer configuration,
CUDA-graph decode wrappers for pure-decode (padded) steps — all run through the emulator
against torch_native."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.emulators import FlashInferEmulatedBackend
from attnplug.backends.emulators.testing import make_paged_batch, torch_native_reference
from attnplug.backends.flashinfer import FlashInferImpl, FlashInferMetadataBuilder, gather_page_indices, page_metadata
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.contracts import AttentionCGSupport, BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.runner.execute.cudagraph import PaddedMetadata


def _setup(b, window=None, params=((None, None),), max_reqs=8):
    kw = dict(block_size=b.block_size, num_kv_heads=b.num_kv_heads, head_size=b.head_size, dtype=b.key_cache.dtype)
    spec = SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)
    builder = FlashInferEmulatedBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(max_reqs, 64, 256), "cpu")
    impls = [FlashInferImpl(b.num_heads, b.head_size, scale or b.head_size ** -0.5, b.num_kv_heads,
                            sliding_window=window, logits_soft_cap=cap) for scale, cap in params]
    return builder, impls


def _forward(impl, b, md, num_tokens=None):
    n = num_tokens or b.query.shape[0]
    pad = n - b.query.shape[0]
    q, k, v = (torch.cat([t, torch.full((pad, *t.shape[1:]), -7.0)]) for t in (b.query, b.key, b.value))
    kv = torch.stack([b.key_cache, b.value_cache], dim=1)
    out = torch.zeros_like(q)
    impl.forward(None, q, k, v, kv, md, out)
    return out, kv


def test_page_metadata_is_vectorized_csr_matching_the_naive_definition():
    rng = np.random.default_rng(0)
    for page_size in (1, 4, 16):
        lens = rng.integers(0, 70, size=12)
        indptr, last, n = page_metadata(lens, page_size)
        want_n = [-(-int(x) // page_size) for x in lens]
        assert n.tolist() == want_n and indptr.tolist() == np.concatenate([[0], np.cumsum(want_n)]).tolist()
        assert ((1 <= last) & (last <= page_size)).all()
        has = n > 0
        assert (page_size * (n[has] - 1) + last[has] == lens[has]).all()  # FlashInfer's KV length formula
    table = torch.tensor([[5, 6, 7], [9, 0, 0], [1, 2, 0]], dtype=torch.int32)
    indptr, _, n = page_metadata(np.array([9, 1, 0]), 4)
    assert gather_page_indices(table, indptr, n).tolist() == [5, 6, 7, 9]


def test_mixed_batch_split_plans_and_result():
    b = make_paged_batch([7, 12, 0, 5], [1, 1, 6, 9], block_size=4, seed=11)
    builder, (impl,) = _setup(b)
    md = builder.build(0, b.cm)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.num_prefill_tokens) == (2, 2, 2, 15)
    assert md.qo_indptr.tolist() == [0, 6, 15] and md.qo_indptr.dtype == torch.int32
    lens = b.cm.seq_lens.tolist()
    assert md.paged_kv_indptr.tolist() == np.concatenate([[0], np.cumsum([-(-n // 4) for n in lens])]).tolist()
    assert md.paged_kv_last_page_len.tolist() == [(n - 1) % 4 + 1 for n in lens]
    assert md.paged_kv_indices.tolist() == [x for ids, n in zip(b.block_ids, lens) for x in ids[: -(-n // 4)]]
    assert all(t.dtype == torch.int32 for t in (md.paged_kv_indptr, md.paged_kv_indices, md.paged_kv_last_page_len))
    (key,) = md.plans
    assert key.window_left == -1 and md.plans[key].decode.num_plans == 1 and md.plans[key].prefill.num_plans == 1
    out, _ = _forward(impl, b, md)
    torch.testing.assert_close(out, torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_one_plan_per_distinct_layer_configuration_and_window_left():
    b = make_paged_batch([9, 0], [1, 5], block_size=4, seed=1)
    params = ((None, None), (None, 2.0), (0.5, 2.0), (None, None))
    builder, impls = _setup(b, window=5, params=params)
    md = builder.build(0, b.cm)
    assert len(md.plans) == 3  # the 4th layer repeats the first one's configuration
    assert {k.window_left for k in md.plans} == {4}  # W = 5 -> window_left = 4
    for impl, (scale, cap) in zip(impls, params):
        out, _ = _forward(impl, b, md)
        torch.testing.assert_close(out, torch_native_reference(b, scale, 5, cap), atol=1e-5, rtol=1e-5)


def test_pure_decode_padded_graph_step_uses_graph_wrappers_on_fixed_buffers():
    b = make_paged_batch([7, 12, 3], [1, 1, 1], block_size=4, seed=5)
    builder, (impl,) = _setup(b)
    cm = b.cm.replace(slot_mapping=torch.cat([b.cm.slot_mapping, torch.full((1,), -1)]))
    md = builder.build_for_cudagraph_capture(PaddedMetadata(8, "cpu").pad([cm], 4)[0])
    ptr = md.paged_kv_indptr.tolist()
    assert md.num_decode_tokens == 4 and len(ptr) == 5 and ptr[4] == ptr[3]  # the padded request owns no page
    wrapper = next(iter(md.plans.values())).decode
    assert wrapper.use_cuda_graph and builder._indptr_buf[:5].tolist() == md.paged_kv_indptr.tolist()
    assert md.slot_mapping.data_ptr() == builder._slot_mapping_buf.data_ptr()
    out, kv = _forward(impl, b, md, num_tokens=4)
    torch.testing.assert_close(out[:3], torch_native_reference(b), atol=1e-5, rtol=1e-5)
    again = builder.build_for_cudagraph_capture(PaddedMetadata(8, "cpu").pad([cm], 4)[0])
    assert next(iter(again.plans.values())).decode is wrapper  # one graph wrapper per batch size, re-planned
    # eager builds of the same padded shape plan the ordinary wrapper: no graph wrapper per batch size
    eager = builder.build(0, PaddedMetadata(8, "cpu").pad([cm], 4)[0])
    assert not next(iter(eager.plans.values())).decode.use_cuda_graph
    assert eager.slot_mapping.data_ptr() == cm.slot_mapping.data_ptr() or torch.equal(eager.slot_mapping, cm.slot_mapping)


def test_graph_builds_take_pure_decodes_only():
    b = make_paged_batch([7, 0], [1, 5], block_size=4, seed=5)
    builder, _ = _setup(b)
    with pytest.raises(MetadataError, match="UNIFORM_SINGLE_TOKEN_DECODE"):
        builder.build_for_cudagraph_capture(b.cm)


def test_decodes_after_a_prefill_are_rejected():
    b = make_paged_batch([0, 7], [5, 1], block_size=4)
    builder, _ = _setup(b)
    with pytest.raises(MetadataError, match="reorder_batch_threshold"):
        builder.build(0, b.cm)


def test_the_step_compiler_honours_reorder_batch_threshold():
    from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
    from attnplug.runner.step.compiler import StepCompiler

    assert FlashInferMetadataBuilder.reorder_batch_threshold == 1
    sc = StepCompiler([4], max_num_reqs=4, max_model_len=64, max_num_batched_tokens=32,
                      reorder_batch_threshold=FlashInferMetadataBuilder.reorder_batch_threshold)
    new = [NewRequestData(req_id=r, prompt_token_ids=[1] * n, block_ids=[[i * 4 + j + 1 for j in range(4)]],
                          num_computed_tokens=0) for i, (r, n) in enumerate([("a", 6), ("b", 1), ("c", 5)])]
    so = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(),
                         num_scheduled_tokens={"a": 6, "b": 1, "c": 5})
    sc.update_states(so)
    inputs = sc.prepare_inputs(so)
    assert inputs.req_ids[0] == "b" and inputs.num_scheduled_tokens.tolist()[0] == 1


def test_cudagraph_support_and_missing_plans():
    assert FlashInferMetadataBuilder.get_cudagraph_support() is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    b = make_paged_batch([3], [1], block_size=4)
    builder, _ = _setup(b, params=())
    md = builder.build(0, b.cm)
    impl = FlashInferImpl(b.num_heads, b.head_size, 0.25, b.num_kv_heads)  # created after the build
    with pytest.raises(MetadataError, match="create every layer's impl before the first build"):
        _forward(impl, b, md)


def test_a_page_or_slot_outside_the_cache_is_refused_before_the_write():
    """FlashInfer's kernels index the cache with paged_kv_indices unchecked; on CPU tensors
    (and on a GPU with ATTNPLUG_VALIDATE=1) the impl checks them and the slots first."""
    b = make_paged_batch([5, 1, 0], [1, 1, 3], block_size=4)  # decodes first, as flashinfer wants
    builder, (impl,) = _setup(b)
    num_blocks = b.key_cache.shape[0]
    table = b.cm.block_table_tensor.clone()
    table[1, 0] = num_blocks
    md = builder.build(0, b.cm.replace(block_table_tensor=table))
    kv = torch.stack([b.key_cache, b.value_cache], dim=1)
    before = kv.clone()
    with pytest.raises(MetadataError, match=rf"page id {num_blocks} \(entry \d+\) is not a block of the cache"):
        impl.forward(None, b.query, b.key, b.value, kv, md, torch.zeros_like(b.query))
    slots = b.cm.slot_mapping.clone()
    slots[0] = -3
    md = builder.build(0, b.cm.replace(slot_mapping=slots))
    with pytest.raises(MetadataError, match=r"slot_mapping\[0\] = -3"):
        impl.forward(None, b.query, b.key, b.value, kv, md, torch.zeros_like(b.query))
    assert torch.equal(kv, before), "nothing was written"
