"""A builder that kept the last step's structural pass (triton, flash_attn: the same four
tensor objects and row count build without calling the checks again) still refuses every
step the full checks refuse: a host int past the pass's bounds, another row count, another
tensor object; ``update_block_table`` likewise. With ``ATTNPLUG_VALIDATE=1`` no pass is kept
(the host values are checked on every build), and a warm build equals a fresh one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.backends.common.buffer_checks import NOT_PASSED
from attnplug.backends.emulators import FlashAttn3EmulatedBackend
from attnplug.backends.triton import TritonMetadataBuilder
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import BuilderConfig
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32)
CFG = BuilderConfig(max_num_reqs=3, max_num_batched_tokens=64, max_model_len=64)  # 4 blocks per request
BUILDERS = [TritonMetadataBuilder, FlashAttn3EmulatedBackend.get_builder_cls()]
IDS = ["triton", "flash_attn"]


def _step():
    """Two decoding requests (seq_lens 20, 6), slot mapping padded to 4, block table 3 columns."""
    cm = CommonAttentionMetadata.from_lengths([19, 5], [1, 1], [[1, 2, 0], [3, 0, 0]], block_size=16)
    return cm.replace(slot_mapping=torch.cat([cm.slot_mapping, torch.full((2,), PAD_SLOT_ID)]))


def _warm(cls, monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    b, cm = cls(SPEC, ["l0"], CFG, "cpu"), _step()
    b.build(0, cm)
    b.build(0, cm)
    assert b._passed[0] is cm.query_start_loc, "the pass is kept"
    return b, cm


BAD_HOST_INTS = [
    (dict(num_actual_tokens=5), "slot_mapping has 4 entries"),
    (dict(max_seq_len=49), "needs 4 blocks"),  # 3 columns
    (dict(num_reqs=3), "num_reqs=3|for 3 rows|3 request rows"),
]


@pytest.mark.parametrize("cls", BUILDERS, ids=IDS)
@pytest.mark.parametrize("change, needle", BAD_HOST_INTS)
def test_a_warm_build_refuses_host_ints_past_the_pass(cls, change, needle, monkeypatch):
    b, cm = _warm(cls, monkeypatch)
    with pytest.raises(MetadataError, match=needle):
        b.build(0, cm.replace(**change))
    assert b.build(0, cm).num_actual_tokens == 2, "the good step builds again"


@pytest.mark.parametrize("cls", BUILDERS, ids=IDS)
def test_a_warm_build_checks_another_tensor_object_in_full(cls, monkeypatch):
    b, cm = _warm(cls, monkeypatch)
    with pytest.raises(MetadataError, match="slot_mapping is torch.int32"):
        b.build(0, cm.replace(slot_mapping=cm.slot_mapping.to(torch.int32)))
    with pytest.raises(MetadataError, match="block_table_tensor is torch.int64"):
        b.build(0, cm.replace(block_table_tensor=cm.block_table_tensor.long()))
    with pytest.raises(MetadataError, match="seq_lens is torch.int64"):
        b.build(0, cm.replace(seq_lens=cm.seq_lens.long()))
    wide = cm.replace(query_start_loc=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32), num_reqs=4)  # > max_num_reqs
    with pytest.raises(MetadataError, match="max_num_reqs"):
        b.build(0, wide)


@pytest.mark.parametrize("cls", BUILDERS, ids=IDS)
def test_a_warm_build_equals_a_fresh_one(cls, monkeypatch):
    b, cm = _warm(cls, monkeypatch)
    for change in (dict(num_actual_tokens=3, max_query_len=2), dict(max_seq_len=48), dict(causal=False), {}):
        step = cm.replace(**change)  # the same tensor objects, other host ints
        warm, fresh = b.build(0, step), cls(SPEC, ["l0"], CFG, "cpu").build(0, step)
        assert type(warm) is type(fresh)
        for f in dataclasses.fields(fresh):
            name, value = f.name, getattr(fresh, f.name)
            got = getattr(warm, name)
            assert got is value if isinstance(value, torch.Tensor) and cls is TritonMetadataBuilder else (
                torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value), name


@pytest.mark.parametrize("cls", BUILDERS, ids=IDS)
def test_a_warm_update_block_table_refuses_what_the_full_checks_refuse(cls, monkeypatch):
    b, cm = _warm(cls, monkeypatch)
    g1 = cls(SPEC, ["l1"], CFG, "cpu")
    md = b.build(0, cm)
    bt, sm = cm.block_table_tensor.clone(), cm.slot_mapping.clone()
    g1.update_block_table(md, bt, sm)
    out = g1.update_block_table(md, bt, sm)  # warm
    assert out.slot_mapping is sm and out.num_actual_tokens == md.num_actual_tokens
    for change, needle in BAD_HOST_INTS[:2]:
        with pytest.raises(MetadataError, match=needle):
            g1.update_block_table(dataclasses.replace(md, **change), bt, sm)
    with pytest.raises(MetadataError, match="block_table_tensor is torch.int32 \\(1, 3\\)"):
        g1.update_block_table(md, bt[:1], sm)
    with pytest.raises(MetadataError, match="slot_mapping is torch.int32"):  # the same table, another mapping
        g1.update_block_table(md, bt, sm.to(torch.int32))


@pytest.mark.parametrize("cls", BUILDERS, ids=IDS)
def test_with_validation_no_pass_is_kept_and_host_values_are_checked_every_build(cls, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    b, cm = cls(SPEC, ["l0"], CFG, "cpu"), _step()
    b.build(0, cm)
    b.build(0, cm)
    assert b._passed[0] is None and b._passed[:7] == NOT_PASSED
    with pytest.raises(MetadataError, match="max_query_len must bound"):
        b.build(0, cm.replace(max_query_len=0))  # a host-value lie the structure does not see


def test_a_warm_flash_attention_2_build_sums_this_steps_seq_lens(monkeypatch):
    """FA2's ``cu_seqlens_k`` is computed every build (a new tensor), never taken from the kept dict."""
    from attnplug.backends.emulators import FlashAttn2EmulatedBackend

    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    spec = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=32)
    b = FlashAttn2EmulatedBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(3, 64, 512), "cpu")
    cm = CommonAttentionMetadata.from_lengths([19, 5], [1, 1], [[1, 0], [3, 0]], block_size=256)
    first = b.build(0, cm)
    assert b._passed[0] is cm.query_start_loc and first.cu_seqlens_k.tolist() == [0, 20, 26]
    cm.seq_lens.add_(1)  # the next decode step, in the same buffer
    nxt = b.build(0, cm.replace(max_seq_len=21, num_actual_tokens=2))
    assert nxt.cu_seqlens_k.tolist() == [0, 21, 28] and first.cu_seqlens_k.tolist() == [0, 20, 26]
    assert nxt.cu_seqlens_k is not first.cu_seqlens_k and nxt.seq_lens is first.seq_lens


def test_the_split_decision_of_a_build_is_the_policys_on_both_sides_of_the_saturating_count(monkeypatch):
    """``SplitKVPolicy.saturating_num_reqs`` only spares asking the policy: the decision is the same."""
    from attnplug.backends.triton import SplitKVPolicy

    class Splitting(TritonMetadataBuilder):
        split_kv_policy = SplitKVPolicy(min_seq_len=1, min_tokens_per_split=8, max_splits=4)

    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=32)
    b = Splitting(spec, ["l0"], BuilderConfig(80, 128, 64), "cpu")
    sat = b.split_kv_policy.saturating_num_reqs(8, b.num_sms)
    for n in (sat - 1, sat, sat + 1):
        cm = CommonAttentionMetadata.from_lengths([40] * n, [1] * n, [[1, 2, 3]] * n, block_size=16)
        want = b.split_kv_policy.num_kv_splits(n, 8, 1, 41, b.num_sms)
        assert b.build(0, cm).num_kv_splits == want and (want > 1) == (n < sat), n
        assert b.build(0, cm).num_kv_splits == want, "warm: the same decision"


def test_a_graph_build_with_validation_names_the_backend(monkeypatch):
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    b, cm = TritonMetadataBuilder(SPEC, ["l0"], CFG, "cpu"), _step()
    with pytest.raises(MetadataError, match="the triton builder needs torch.int32"):
        b.build_for_cudagraph_capture(cm.replace(seq_lens=cm.seq_lens.long()))
