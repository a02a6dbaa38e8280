"""The flashinfer builder at its edges (mutation-testing survivors, issue 23): the module
it finds installed, every argument it hands the wrappers' constructors and ``plan()``
(recorded around the emulated wrappers), wrapper reuse per configuration, the workspace,
the buffers' shapes, dtypes and devices, and every refusal's exact message."""

from __future__ import annotations

import dataclasses
import gc
import re
from types import SimpleNamespace

import pytest
import torch

import attnplug.backends.flashinfer.builder as builder_module
from attnplug.backends.emulators import EMULATED_FLASHINFER, FlashInferEmulatedBackend
from attnplug.backends.emulators.testing import make_paged_batch
from attnplug.backends.flashinfer import FlashInferImpl, FlashInferMetadataBuilder
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import BackendUnsupportedError, MetadataError


class _Recorder:
    """A ``flashinfer`` stand-in: the emulated wrappers, each construction and plan recorded."""

    def __init__(self):
        self.calls: list[tuple] = []
        rec = self

        def wrap(base, kind):
            class W(base):
                def __init__(self, *a, **kw):
                    rec.calls.append((kind, "init", a, kw))
                    super().__init__(*a, **kw)

                def plan(self, *a, **kw):
                    rec.calls.append((kind, "plan", a, kw))
                    super().plan(*a, **kw)
            return W

        self.BatchDecodeWithPagedKVCacheWrapper = wrap(EMULATED_FLASHINFER.BatchDecodeWithPagedKVCacheWrapper, "decode")
        self.BatchPrefillWithPagedKVCacheWrapper = wrap(EMULATED_FLASHINFER.BatchPrefillWithPagedKVCacheWrapper,
                                                        "prefill")

    def of(self, kind, what):
        return [(a, kw) for k, w, a, kw in self.calls if k == kind and w == what]


def _setup(b, window=None, num_heads=None, max_reqs=8, cap=None, validate=True):
    gc.collect()  # impls of earlier tests (held weakly, in reference cycles) would add their own plans
    rec = _Recorder()

    class Builder(FlashInferEmulatedBackend.get_builder_cls()):
        @classmethod
        def load_flashinfer(cls):
            return rec

    kw = dict(block_size=b.block_size, num_kv_heads=b.num_kv_heads, head_size=b.head_size, dtype=b.key_cache.dtype)
    spec = SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)
    builder = Builder(spec, ["l0"], BuilderConfig(max_reqs, 64, 256), "cpu")
    builder.validate_values = validate
    impl = FlashInferImpl(num_heads or b.num_heads, b.head_size, 0.25, b.num_kv_heads, sliding_window=window,
                          logits_soft_cap=cap)
    return builder, impl, rec


def test_the_module_comes_from_the_installed_flashinfer(monkeypatch):
    monkeypatch.setattr(builder_module, "installed_module", lambda: None)
    monkeypatch.setattr(builder_module, "unavailable_reason", lambda: "flashinfer 9.9 failed to import")
    with pytest.raises(BackendUnsupportedError) as e:
        FlashInferMetadataBuilder.load_flashinfer()
    assert e.value.backend_name == "flashinfer" and e.value.reasons == ["flashinfer 9.9 failed to import"]
    assert "cannot serve for FlashInferMetadataBuilder:" in str(e.value)
    monkeypatch.setattr(builder_module, "unavailable_reason", lambda: None)
    with pytest.raises(BackendUnsupportedError) as e:
        FlashInferMetadataBuilder.load_flashinfer()
    assert e.value.reasons == ["flashinfer unavailable"]
    monkeypatch.setattr(builder_module, "installed_module", lambda: EMULATED_FLASHINFER)
    assert FlashInferMetadataBuilder.load_flashinfer() is EMULATED_FLASHINFER


def test_buffers_window_and_limits():
    b = make_paged_batch([3], [1], block_size=4)
    builder, _, _ = _setup(b, window=5, max_reqs=3)
    assert builder.sliding_window == 5 and builder.window_left == 4 and builder.max_num_blocks_per_req == 64
    assert builder.validate_values is True
    for buf, shape, dtype in ((builder._indptr_buf, (4,), torch.int32), (builder._indices_buf, (192,), torch.int32),
                              (builder._last_page_len_buf, (3,), torch.int32),
                              (builder._slot_mapping_buf, (64,), torch.int64)):
        assert tuple(buf.shape) == shape and buf.dtype == dtype and buf.device == torch.device("cpu")
    assert (builder._slot_mapping_buf == PAD_SLOT_ID).all() and (builder._last_page_len_buf == 1).all()
    full, _, _ = _setup(b)
    assert full.sliding_window is None and full.window_left == -1
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype=torch.float32)
    for cfg in (BuilderConfig(0, 64, 256), BuilderConfig(8, 0, 256), BuilderConfig(8, 64, 0)):
        with pytest.raises(MetadataError, match=re.escape("FlashInferMetadataBuilder: BuilderConfig limits must be "
                                                          f"positive, got {cfg}")):
            FlashInferMetadataBuilder(spec, ["l0"], cfg, "cpu")
    FlashInferMetadataBuilder(spec, ["l0"], BuilderConfig(1, 1, 1), "cpu")  # 1 is allowed everywhere


def test_every_wrapper_argument_and_reuse():
    b = make_paged_batch([7, 0], [1, 5], block_size=4, num_heads=4, num_kv_heads=2, seed=3)
    builder, _, rec = _setup(b, window=5, cap=30.0)
    md = builder.build(0, b.cm)
    ((da, dkw),) = rec.of("decode", "init")
    assert da[1:] == ("NHD",) and dkw == {"use_tensor_cores": False}
    ws = da[0]
    assert ws.dtype == torch.uint8 and ws.shape == (1024,) and ws.device == torch.device("cpu")
    ((pa, pkw),) = rec.of("prefill", "init")
    assert pa[0] is ws and pa[1:] == ("NHD",) and pkw == {}
    ((a, kw),) = rec.of("decode", "plan")
    assert a[0].tolist() == [0, 2] and a[1].tolist() == md.paged_kv_indices.tolist() and a[2].tolist() == [4]
    assert a[3:] == (4, 2, 16, 4)
    assert kw == dict(window_left=4, logits_soft_cap=30.0, q_data_type=torch.float32, kv_data_type=torch.float32,
                      sm_scale=0.25)
    ((a, kw),) = rec.of("prefill", "plan")
    assert a[0].tolist() == [0, 5] and a[1].tolist() == [0, 2] and a[3].tolist() == [1]
    assert a[2].tolist() == md.paged_kv_indices.tolist()[2:] and a[4:] == (4, 2, 16, 4)
    assert kw == dict(causal=True, sm_scale=0.25, window_left=4, logits_soft_cap=30.0, q_data_type=torch.float32,
                      kv_data_type=torch.float32)
    assert md.num_reqs == 2 and md.num_prefills == 1
    key = next(iter(md.plans))
    builder.build(0, b.cm)  # md is alive: it keeps its wrappers, this build plans new ones (re-entrancy)
    assert len(rec.of("decode", "init")) == 2 and len(rec.of("prefill", "init")) == 2
    del md  # dropped (the second metadata was never kept): the next build re-plans a free wrapper
    builder.build(0, b.cm)
    assert len(rec.of("decode", "init")) == 2 and len(rec.of("prefill", "init")) == 2
    assert len(rec.of("decode", "plan")) == 3 and len(rec.of("prefill", "plan")) == 3
    assert set(builder._wrappers) == {("decode", key), ("prefill", key)}
    assert all(len(pool) == 2 for pool in builder._wrappers.values())


@pytest.mark.parametrize("num_heads,tensor_cores", [(8, False), (10, True), (16, True)])
def test_tensor_cores_above_group_size_4(num_heads, tensor_cores):
    b = make_paged_batch([3], [1], block_size=4, num_heads=num_heads, num_kv_heads=2)
    builder, _, rec = _setup(b, num_heads=num_heads)
    builder.build(0, b.cm)  # group 4: CUDA cores; group 5 (10 // 2) and 8: tensor cores
    ((_, kw),) = rec.of("decode", "init")
    assert kw == {"use_tensor_cores": tensor_cores}


def test_graph_decode_wrapper_arguments_and_slot_mapping():
    b = make_paged_batch([3, 6], [1, 1], block_size=4, seed=2)
    builder, _, rec = _setup(b)
    md = builder.build_for_cudagraph_capture(b.cm)
    ((a, kw),) = rec.of("decode", "init")
    assert a[1:] == ("NHD",) and kw["use_cuda_graph"] is True and kw["use_tensor_cores"] is False
    assert kw["paged_kv_indptr_buffer"].shape == (3,) and kw["paged_kv_last_page_len_buffer"].shape == (2,)
    assert kw["paged_kv_indices_buffer"] is builder._indices_buf
    assert md.slot_mapping.data_ptr() == builder._slot_mapping_buf.data_ptr()
    assert md.slot_mapping.tolist() == b.cm.slot_mapping.tolist() and md.num_reqs == 2
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 2, 0)


def test_graph_build_refuses_prefills_with_the_count():
    b = make_paged_batch([3, 0, 0], [1, 4, 2], block_size=4)
    builder, _, rec = _setup(b)
    with pytest.raises(MetadataError) as e:
        builder.build_for_cudagraph_capture(b.cm)
    assert str(e.value) == (
        "build_for_cudagraph_capture got 2 prefill request(s) among 3: flashinfer's CUDA graphs hold pure "
        "single-token decode batches only (UNIFORM_SINGLE_TOKEN_DECODE); build mixed steps eagerly with build().")
    assert rec.calls == []


def test_single_decode_and_prefill_only_batches():
    b = make_paged_batch([5], [1], block_size=4)
    builder, _, rec = _setup(b)
    md = builder.build(0, b.cm)  # one request, a decode: decode planned, no prefill
    assert md.num_reqs == 1 and md.num_decode_tokens == 1 and rec.of("prefill", "plan") == []
    assert md.paged_kv_indptr.tolist() == [0, 2]
    b = make_paged_batch([0, 4], [3, 2], block_size=4)
    builder, _, rec = _setup(b)
    md = builder.build(0, b.cm)
    assert rec.of("decode", "plan") == [] and md.num_decode_tokens == 0
    ((a, _),) = rec.of("prefill", "plan")
    assert a[1].tolist() == [0, 1, 3] and a[3].tolist() == [3, 2]


def _cm(b, **changes):
    return dataclasses.replace(b.cm, **changes)


def test_structural_refusals_name_the_sizes():
    b = make_paged_batch([3, 2], [1, 1], block_size=4)
    builder, _, rec = _setup(b, max_reqs=2)
    qsl = b.cm.query_start_loc
    with pytest.raises(MetadataError) as e:
        builder.build(0, _cm(b, query_start_loc=torch.cat([qsl, qsl[-1:]])))  # 4 entries > cap + 1 = 3
    assert str(e.value) == ("query_start_loc has 4 entries (host copy 3), seq_lens_cpu 2, for num_reqs=2: need "
                            "num_reqs + 1 <= entries <= BuilderConfig.max_num_reqs + 1 = 3.")
    with pytest.raises(MetadataError) as e:
        builder.build(0, _cm(b, query_start_loc_cpu=b.cm.query_start_loc_cpu[:2]))
    assert str(e.value).startswith("query_start_loc has 3 entries (host copy 2), seq_lens_cpu 2, for num_reqs=2")
    with pytest.raises(MetadataError) as e:
        builder.build(0, _cm(b, seq_lens_cpu=b.cm.seq_lens_cpu[:1]))
    assert str(e.value).startswith("query_start_loc has 3 entries (host copy 3), seq_lens_cpu 1, for num_reqs=2")
    bt = b.cm.block_table_tensor
    for bad in (bt[0], bt[:1], bt.long()):
        with pytest.raises(MetadataError) as e:
            builder.build(0, _cm(b, block_table_tensor=bad))
        assert str(e.value) == (f"block_table_tensor is {bad.dtype} {tuple(bad.shape)} on cpu: flashinfer needs "
                                "int32 [>= 2, max_num_blocks_per_req] on cpu.")
    with pytest.raises(MetadataError) as e:
        builder.build(0, _cm(b, max_seq_len=4 * bt.shape[1] + 1))
    assert str(e.value) == (f"max_seq_len {4 * bt.shape[1] + 1} needs more than the block table's {bt.shape[1]} "
                            "pages of 4 tokens.")
    assert rec.calls == []
    assert builder.build(0, b.cm).num_reqs == 2  # exactly cap requests fit


def test_decodes_first_refusal_names_the_first_prefill():
    b = make_paged_batch([3, 0, 2, 5], [1, 3, 1, 1], block_size=4)
    builder, _, rec = _setup(b)
    with pytest.raises(MetadataError) as e:
        builder.build(0, b.cm)
    assert str(e.value) == (
        "request 1 is a prefill (3 query tokens) but a decode follows it: flashinfer runs decodes first and prefills "
        "last; the runner must honour reorder_batch_threshold = 1 (StepCompiler(reorder_batch_threshold=...)).")
    assert rec.calls == []


def test_value_refusals():
    b = make_paged_batch([3, 0], [1, 2], block_size=4)
    builder, _, rec = _setup(b)
    with pytest.raises(MetadataError) as e:
        builder.build(0, _cm(b, num_actual_tokens=2))
    assert str(e.value) == "query_start_loc_cpu[num_reqs]=3 but num_actual_tokens=2: they must agree."
    sl = b.cm.seq_lens_cpu.clone()
    sl[1] = 1  # query length 2 > seq_len 1
    with pytest.raises(MetadataError) as e:
        builder.build(0, _cm(b, seq_lens_cpu=sl))
    assert str(e.value) == ("request 1: query length 2 with seq_len 1: need 1 <= query_len <= seq_len for every "
                            "real request.")
    qsl = b.cm.query_start_loc_cpu.clone()
    qsl[1] = 0  # request 0 schedules nothing
    with pytest.raises(MetadataError) as e:
        builder.build(0, _cm(b, query_start_loc_cpu=qsl))
    assert str(e.value).startswith("request 0: query length 0 with seq_len 4: need")
    with pytest.raises(MetadataError) as e:
        builder.build(0, _cm(b, max_seq_len=3))
    assert str(e.value) == "max_seq_len=3 but seq_lens holds 4: max_seq_len must bound every seq_len."
    assert rec.calls == []
    sl = b.cm.seq_lens_cpu.clone()
    sl[1] = 2  # query length == seq_len: allowed
    builder.build(0, _cm(b, seq_lens_cpu=sl, seq_lens=sl.clone()))
    builder.build(0, _cm(b, max_seq_len=4))  # max_seq_len == the longest: allowed
    builder.validate_values = False
    builder.build(0, _cm(b, max_seq_len=3))  # not validated: planned as given


def test_padded_mixed_batch_plans_the_real_requests_only():
    from attnplug.runner.execute.cudagraph import PaddedMetadata
    b = make_paged_batch([3, 0], [1, 5], block_size=4, seed=4)
    builder, _, rec = _setup(b)
    cm = PaddedMetadata(8, "cpu").pad([b.cm], 4)[0]  # 2 real requests, 2 padded
    md = builder.build(0, cm)
    assert md.paged_kv_indptr.tolist() == [0, 1, 3] and md.paged_kv_last_page_len.tolist() == [4, 1]
    assert md.qo_indptr.tolist() == [0, 5] and (md.num_decodes, md.num_prefills) == (1, 1)
    ((a, _),) = rec.of("prefill", "plan")
    assert a[0].tolist() == [0, 5] and a[1].tolist() == [0, 2]


def test_single_request_graph_build_and_the_empty_step():
    b = make_paged_batch([6], [1], block_size=4, seed=6)
    builder, _, rec = _setup(b)
    md = builder.build_for_cudagraph_capture(b.cm)  # one request is a pure decode batch
    assert md.num_decode_tokens == 1 and md.slot_mapping.data_ptr() == builder._slot_mapping_buf.data_ptr()
    cm = b.cm
    empty = _cm(b, num_reqs=0, query_start_loc=cm.query_start_loc[:1], query_start_loc_cpu=cm.query_start_loc_cpu[:1],
                seq_lens=cm.seq_lens[:0], seq_lens_cpu=cm.seq_lens_cpu[:0], num_actual_tokens=0,
                slot_mapping=cm.slot_mapping[:0], max_seq_len=0)
    with pytest.raises(MetadataError, match=re.escape("build_for_cudagraph_capture got 0 prefill request(s) among 0")):
        builder.build_for_cudagraph_capture(empty)
    md = builder.build(0, empty)  # validated: nothing to plan, no max over no seq_lens
    assert md.num_reqs == 0 and md.paged_kv_indptr.tolist() == [0] and md.num_decode_tokens == 0


def test_value_checks_follow_attnplug_validate_at_creation(monkeypatch):
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype=torch.float32)
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    assert FlashInferMetadataBuilder(spec, ["l0"], BuilderConfig(2, 8, 16), "cpu").validate_values is True
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "0")
    assert FlashInferMetadataBuilder(spec, ["l0"], BuilderConfig(2, 8, 16), "cpu").validate_values is False
