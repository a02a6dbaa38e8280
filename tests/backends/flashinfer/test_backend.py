"""flashinfer declarations: optional extra (unavailable here with the reason), the NHD
paged layout (attnplug's default), selection rejecting with reasons, doctests."""

from __future__ import annotations

import doctest

import pytest
import torch

from attnplug.backends.flashinfer import FlashInferBackend, builder as fi_builder
from attnplug.backends.flashinfer import backend as fi_backend
from attnplug.backends.flashinfer.kernels import installed_module
from attnplug.core.contracts import AttentionLayerConfig
from attnplug.core.errors import BackendUnsupportedError

needs_no_flashinfer = pytest.mark.skipif(installed_module() is not None, reason="flashinfer is installed here")


@pytest.mark.parametrize("module", [fi_builder, fi_backend])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


@needs_no_flashinfer
def test_unavailable_here_with_the_reason():
    ok, why = FlashInferBackend.is_available()
    assert not ok and "flashinfer package is not installed" in why
    if not torch.cuda.is_available():
        assert "no CUDA device" in why


def test_kv_cache_is_flashinfer_nhd_layout():
    assert FlashInferBackend.get_kv_cache_shape(7, 16, 2, 64) == (7, 2, 16, 2, 64)  # [pages, 2, page, H_kv, D]
    assert FlashInferBackend.supported_kernel_block_sizes is None


@needs_no_flashinfer
def test_explicit_selection_fails_with_the_reasons():
    from attnplug.plugins.selection import select_backend

    layer = AttentionLayerConfig(num_heads=8, num_kv_heads=2, head_size=96, dtype=torch.float16, block_size=16,
                                 device="cuda")
    with pytest.raises(BackendUnsupportedError) as err:
        select_backend(layer, "full_attention", cli_choice="flashinfer")
    assert "flashinfer package is not installed" in str(err.value) and "head_size 96" in str(err.value)


@needs_no_flashinfer
def test_the_real_builder_cannot_plan_without_flashinfer():
    from attnplug.backends.emulators.testing import make_paged_batch
    from attnplug.backends.flashinfer import FlashInferImpl, FlashInferMetadataBuilder
    from attnplug.cache_groups.specs import FullAttentionSpec
    from attnplug.core.contracts import BuilderConfig

    b = make_paged_batch([3], [1], block_size=4)
    spec = FullAttentionSpec(block_size=4, num_kv_heads=b.num_kv_heads, head_size=b.head_size)
    builder = FlashInferMetadataBuilder(spec, ["l0"], BuilderConfig(2, 8, 64), "cpu")
    impl = FlashInferImpl(b.num_heads, b.head_size, 0.25, b.num_kv_heads)  # noqa: F841 (a live layer to plan)
    with pytest.raises(BackendUnsupportedError, match="flashinfer package is not installed"):
        builder.build(0, b.cm)


def test_a_flashinfer_older_than_the_checked_signatures_is_unavailable_with_the_reason(probe_with):
    import types

    from attnplug.backends.flashinfer import kernels

    for version, available in (("0.2.5", False), ("0.6.18.post1", True), ("0.7.4", True)):
        fake = types.ModuleType("flashinfer")
        fake.__version__ = version
        fake.BatchDecodeWithPagedKVCacheWrapper = fake.BatchPrefillWithPagedKVCacheWrapper = object
        module, why = probe_with(kernels, {"flashinfer": fake})
        assert (module is not None) == available, (version, why)
        if not available:
            assert "older than 0.6.18" in why, why
