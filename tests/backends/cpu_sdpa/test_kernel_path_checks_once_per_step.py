"""``cpu_sdpa``'s kernel path checks a step's metadata and tensors once per metadata object and
layer geometry, not per layer (``CpuSdpaAttentionImpl._checked``; ~20-40 µs a layer,
docs/performance.md "SmolLM2's step and two threads"): the layers after the first reuse the
outcome; a layer whose tensors differ (another cache, another row count) is checked anew and
refused before its write; ``ATTNPLUG_VALIDATE=1`` checks every layer.
"""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.cpu_sdpa import CpuSdpaBackend, paged
from attnplug.backends.torch_native.impl import TorchNativeAttentionImpl
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core import BuilderConfig, CommonAttentionMetadata
from attnplug.core.errors import MetadataError

pytestmark = pytest.mark.skipif(not paged.available(), reason="the compiled paged kernel is not built")

D, B, H, HK = 16, 4, 2, 1


def _md():
    """Two decodes over blocks up to id 5 (a cache of 6 blocks holds them)."""
    spec = FullAttentionSpec(block_size=B, num_kv_heads=HK, head_size=D)
    cm = CommonAttentionMetadata.from_lengths([5, 3], [1, 1], [[1, 2, 0, 0], [5, 0, 0, 0]], block_size=B)
    md = CpuSdpaBackend.get_builder_cls()(spec, ["l0", "l1"], BuilderConfig(2, 16, 16), "cpu").build(0, cm)
    assert md.paged_reqs is not None
    return md


def _tensors(num_blocks=6):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, D, generator=gen) for n in (H, HK, HK))
    return q, k, v, torch.zeros(num_blocks, 2, B, HK, D)


def _count_checks(monkeypatch):
    calls = [0]
    real = TorchNativeAttentionImpl._check

    def counted(self, *a, **kw):
        calls[0] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(TorchNativeAttentionImpl, "_check", counted)
    return calls


@pytest.mark.parametrize("validate, expected", [(None, 1), ("1", 3)])
def test_the_layers_of_a_step_share_one_check_unless_validate_is_set(monkeypatch, validate, expected):
    if validate is None:
        monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    else:
        monkeypatch.setenv("ATTNPLUG_VALIDATE", validate)
    calls = _count_checks(monkeypatch)
    md = _md()
    impl = CpuSdpaBackend.get_impl_cls()(H, D, D ** -0.5, HK)
    outs = []
    for _ in range(3):  # three layers, one metadata object, the same geometry
        q, k, v, kv = _tensors()
        outs.append(impl.forward(None, q, k, v, kv, md, torch.empty_like(q)))
    assert calls[0] == expected
    assert all(torch.equal(o, outs[0]) for o in outs)
    calls[0] = 0
    q, k, v, kv = _tensors()
    impl.forward(None, q, k, v, kv, _md(), torch.empty_like(q))  # the next step's metadata: checked again
    assert calls[0] == 1


def test_a_later_layer_with_a_smaller_cache_is_refused_before_its_write(monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    md = _md()
    impl = CpuSdpaBackend.get_impl_cls()(H, D, D ** -0.5, HK)
    q, k, v, kv = _tensors()
    impl.forward(None, q, k, v, kv, md, torch.empty_like(q))  # 6 blocks: fine
    q, k, v, small = _tensors(num_blocks=4)  # block 5 is past it
    with pytest.raises(MetadataError, match="names block 5, the KV cache has 4 blocks"):
        impl.forward(None, q, k, v, small, md, torch.empty_like(q))
    assert (small == 0).all()  # refused before the write


def test_a_later_layer_with_other_shapes_is_refused(monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VALIDATE", raising=False)
    md = _md()
    impl = CpuSdpaBackend.get_impl_cls()(H, D, D ** -0.5, HK)
    q, k, v, kv = _tensors()
    impl.forward(None, q, k, v, kv, md, torch.empty_like(q))
    with pytest.raises(MetadataError, match="fewer rows than num_actual_tokens"):
        impl.forward(None, q[:1], k[:1], v[:1], kv, md, torch.empty_like(q[:1]))
    with pytest.raises(ValueError, match="contiguous last dim"):  # the kernel's layout check, not memoised
        impl.forward(None, q, k, v, kv, md, torch.empty(2, H, 2 * D)[:, :, ::2])
