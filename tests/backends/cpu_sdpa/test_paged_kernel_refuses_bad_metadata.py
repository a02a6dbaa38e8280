"""The compiled paged kernel (``backends/cpu_sdpa/paged.py``) refuses metadata the tensors
cannot hold with ``MetadataError`` before it reads or writes anything (each case below was a
segfault or a silent read of garbage; through the backend, a negative slot or block id
wrapped silently into the cache's last blocks), takes ``-1`` padding in the columns it does not read,
and lets a NaN in a key a row sees poison that row, as ``torch_native`` does (a dropped NaN
would hide a read of a poisoned slot).
"""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.cpu_sdpa import CpuSdpaBackend, paged
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core import BuilderConfig, CommonAttentionMetadata
from attnplug.core.errors import MetadataError

pytestmark = pytest.mark.skipif(not paged.available(), reason="the compiled paged kernel is not built")

D, B, H, HK = 16, 4, 2, 1


def _step(ql=2, L=6, table=((1, 2, -1, -1),)):
    """One request of ``ql`` query tokens over ``L`` keys in a 4-block NaN-free cache."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(ql, H, D, generator=gen)
    kv = torch.randn(4, 2, B, HK, D, generator=gen)
    return (q, kv, torch.tensor(table, dtype=torch.int32), torch.tensor([0, ql], dtype=torch.int32),
            torch.tensor([L], dtype=torch.int32), torch.tensor([0], dtype=torch.int64))


def _call(q, kv, bt, qsl, sl, reqs, out=None, **kw):
    out = torch.full_like(q, 7.0) if out is None else out
    return paged.paged_attention(out, q, kv, bt, qsl, sl, reqs, scale=D ** -0.5, **kw)


@pytest.mark.parametrize("field, change, word", [
    ("bt", lambda t: t.__setitem__((0, 0), -1), "block id -1"),
    ("bt", lambda t: t.__setitem__((0, 1), 4), "block id 4"),
    ("bt", lambda t: t.__setitem__((0, 1), 2 ** 31 - 1), "outside the KV cache"),
    ("qsl", lambda t: t.__setitem__(1, 100), "past the 2 query rows"),
    ("qsl", lambda t: t.__setitem__(0, -3), "negative, decreasing"),
    ("sl", lambda t: t.__setitem__(0, 17), "more than the block table's 4 columns"),
    ("sl", lambda t: t.__setitem__(0, 1), "shorter than its query"),
    ("reqs", lambda t: t.__setitem__(0, 1), "request index 1"),
    ("reqs", lambda t: t.__setitem__(0, -1), "request index -1"),
])
def test_metadata_the_tensors_cannot_hold_is_refused_before_any_read(field, change, word):
    q, kv, bt, qsl, sl, reqs = _step()
    change({"bt": bt, "qsl": qsl, "sl": sl, "reqs": reqs}[field])
    out = torch.full_like(q, 7.0)
    with pytest.raises(MetadataError, match=word):
        _call(q, kv, bt, qsl, sl, reqs, out=out)
    assert (out == 7.0).all()  # nothing written


@pytest.mark.parametrize("shape", [(4, 2, 0, HK, D), (4, 2, B, 0, D)])
def test_an_empty_block_or_head_axis_is_refused_not_divided_by(shape):
    q, kv, bt, qsl, sl, reqs = _step()
    with pytest.raises(ValueError, match="block_size >= 1, num_kv_heads >= 1"):
        _call(q, torch.zeros(shape), bt, qsl, sl, reqs)
    with pytest.raises(MetadataError, match="block_size >= 1"):
        paged.check_metadata(2, torch.zeros(4, 2, 0, HK, D), bt, qsl, sl, reqs)


@pytest.mark.parametrize("kw", [dict(sliding_window=0), dict(sliding_window=-4), dict(logits_soft_cap=0.0),
                                dict(logits_soft_cap=-3.0), dict(logits_soft_cap=float("nan"))])
def test_a_window_or_cap_the_kernel_would_ignore_is_refused(kw):
    q, kv, bt, qsl, sl, reqs = _step()
    with pytest.raises(ValueError, match="a window >= 1 token and a cap > 0"):
        _call(q, kv, bt, qsl, sl, reqs, **kw)


def test_unread_columns_may_hold_padding_and_views_are_read_at_their_offset():
    q, kv, bt, qsl, sl, reqs = _step(ql=1, L=8, table=((-1, 2, 3, -1),))
    # window 3 at position 7 reads keys 5..7: block columns 1 and 2 only
    got = _call(q, kv, bt, qsl, sl, reqs, sliding_window=3)
    keys = torch.cat([kv[2, :, :], kv[3, :, :]], dim=1)[:, 1:4, 0]  # [2, 3, D]: positions 5..7
    logits = (q[0] @ keys[0].T) * D ** -0.5  # [H, 3]
    torch.testing.assert_close(got[0], torch.softmax(logits, -1) @ keys[1])
    # the same cache as a view at a nonzero storage offset, the table wider than needed
    big = torch.cat([torch.full_like(kv[:1], float("nan")), kv])[1:]
    wide = torch.cat([bt, torch.full((1, 5), -1, dtype=torch.int32)], dim=1)
    torch.testing.assert_close(_call(q, big, wide, qsl, sl, reqs, sliding_window=3), got)
    # a window past any int32 context is no window (not an OverflowError)
    full = torch.tensor([[1, 2, 3, -1]], dtype=torch.int32)
    assert torch.equal(_call(q, kv, full, qsl, sl, reqs, sliding_window=2 ** 40), _call(q, kv, full, qsl, sl, reqs))


def test_a_nan_in_a_key_a_row_sees_poisons_that_row_as_torch_native():
    q, kv, bt, qsl, sl, reqs = _step(ql=2, L=6)  # rows at positions 4 and 5
    kv[2, 0, 1] = float("nan")  # the key at position 5: only the last row sees it
    kv[2, :, 2:] = float("nan")  # past seq_len: never read
    got = _call(q, kv, bt, qsl, sl, reqs)
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all()
    spec = FullAttentionSpec(block_size=B, num_kv_heads=HK, head_size=D)
    cm = CommonAttentionMetadata.from_lengths([4], [2], [[1, 2, 0, 0]], block_size=B)
    ref = TorchNativeBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(1, 16, 16), "cpu").build(0, cm)
    impl = TorchNativeBackend.get_impl_cls()(H, D, D ** -0.5, HK)
    k, v = kv[[1, 2], 0].reshape(8, HK, D)[4:6], kv[[1, 2], 1].reshape(8, HK, D)[4:6]
    expected = impl.forward(None, q, k, v, kv.clone(), ref, torch.empty_like(q))
    assert torch.equal(torch.isnan(expected), torch.isnan(got))


def test_a_negative_block_id_through_the_backend_contract_is_refused_before_the_write():
    spec = SlidingWindowSpec(block_size=B, num_kv_heads=HK, head_size=D, sliding_window=64)
    cm = CommonAttentionMetadata.from_lengths([5], [1], [[-1, 1, 0, 0]], block_size=B)  # the write: slot 5
    md = CpuSdpaBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(1, 16, 16), "cpu").build(0, cm)
    assert md.paged_reqs is not None  # the kernel's metadata: the max-id check alone passes -1
    impl = CpuSdpaBackend.get_impl_cls()(H, D, D ** -0.5, HK, sliding_window=64)
    q, k, v = torch.randn(1, H, D), torch.randn(1, HK, D), torch.randn(1, HK, D)
    kv = torch.zeros(4, 2, B, HK, D)
    with pytest.raises(MetadataError, match="block id -1"):
        impl.forward(None, q, k, v, kv, md, torch.empty_like(q))
    assert (kv == 0).all()  # refused before the write


@pytest.mark.parametrize("backend, message", [
    ("cpu_sdpa", "slot {slot}, outside the KV cache's 16 slots"),  # the kernel path's range check
    ("torch_native", "slot_mapping\\[0\\] = {slot} is outside the cache's 16 slots"),
    ("cpu_sdpa-gather", "slot_mapping\\[0\\] = {slot} is outside the cache's 16 slots"),
])
@pytest.mark.parametrize("slot", [-3, 16])
def test_a_slot_outside_the_cache_is_refused_before_the_write(backend, message, slot):
    """Every CPU path's write indexes the cache with torch's advanced indexing: slot -3
    would land silently in block 3, slot 16 raise torch's IndexError. Each refuses both
    with the project's error and leaves the cache as it was."""
    from attnplug.backends.cpu_sdpa.backend import CpuSdpaGatherBackend
    cls = {"cpu_sdpa": CpuSdpaBackend, "torch_native": TorchNativeBackend,
           "cpu_sdpa-gather": CpuSdpaGatherBackend}[backend]
    spec = FullAttentionSpec(block_size=B, num_kv_heads=HK, head_size=D)
    cm = CommonAttentionMetadata.from_lengths([5], [1], [[1, 2, 0, 0]], block_size=B)
    cm = cm.replace(slot_mapping=torch.tensor([slot]))
    md = cls.get_builder_cls()(spec, ["l0"], BuilderConfig(1, 16, 16), "cpu").build(0, cm)
    impl = cls.get_impl_cls()(H, D, D ** -0.5, HK)
    q, k, v = torch.randn(1, H, D), torch.randn(1, HK, D), torch.randn(1, HK, D)
    kv = torch.zeros(4, 2, B, HK, D)
    with pytest.raises(MetadataError, match=message.format(slot=slot)):
        impl.forward(None, q, k, v, kv, md, torch.empty_like(q))
    assert (kv == 0).all()

