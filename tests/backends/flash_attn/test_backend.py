"""flash_attn declarations: optional extra (unavailable here with the reason), version-
dependent kernel block sizes, the separate K/V cache layout, selection rejecting with
reasons; the emulated backends are never registered; the shared helpers' doctests."""

from __future__ import annotations

import doctest

import pytest
import torch

from attnplug.backends.common import cache_write, layer_params, merge, versions, window
from attnplug.backends.emulators import FlashAttn2EmulatedBackend, FlashAttn3EmulatedBackend, FlashInferEmulatedBackend
from attnplug.backends.flash_attn import FlashAttnBackend, backend as fa_backend
from attnplug.backends.flash_attn.kernels import installed_kernels
from attnplug.core.contracts import AttentionLayerConfig
from attnplug.core.errors import BackendUnsupportedError
from attnplug.plugins import get_registry

needs_no_flash_attn = pytest.mark.skipif(installed_kernels() is not None, reason="flash-attn is installed here")


@pytest.mark.parametrize("module", [cache_write, layer_params, merge, versions, window, fa_backend])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


@needs_no_flash_attn
def test_unavailable_here_with_the_reason():
    ok, why = FlashAttnBackend.is_available()
    assert not ok and "flash-attn package is not installed" in why
    if not torch.cuda.is_available():
        assert "no CUDA device" in why
    assert FlashAttnBackend.kernels_version() is None


@needs_no_flash_attn
def test_kernel_block_sizes_follow_the_version():
    assert FlashAttnBackend.supported_kernel_block_sizes == (256, 512, 1024, 2048)  # the FA2 default
    assert FlashAttnBackend.get_supported_kernel_block_size(16) is None
    assert FlashAttnBackend.get_supported_kernel_block_size(512) == 512
    assert FlashAttnBackend.get_supported_kernel_block_size(768) == 256
    assert FlashAttn3EmulatedBackend.supported_kernel_block_sizes is None  # FA3: any page size
    assert FlashAttn2EmulatedBackend.get_supported_kernel_block_size(16) is None


def test_kv_cache_layout_is_two_contiguous_paged_halves():
    shape = FlashAttnBackend.get_kv_cache_shape(5, 4, 2, 8)
    cache = torch.zeros(shape)
    k, v = FlashAttnBackend.split_kv_cache(cache)
    assert shape == (2, 5, 4, 2, 8) and k.is_contiguous() and v.is_contiguous()
    k[1, 2, 1, 3] = 1.0
    assert float(cache[0].sum()) == 1.0 and float(cache[1].sum()) == 0.0


def test_validate_configuration_lists_every_reason():
    layer = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=60, dtype=torch.float32, block_size=16,
                                 device="cpu", kv_cache_dtype=torch.float16)
    reasons = " | ".join(FlashAttnBackend.validate_configuration(layer))
    for needle in ("float32", "head_size 60", "device 'cpu'", "kv_cache_dtype"):
        assert needle in reasons, reasons
    if installed_kernels() is None:
        assert "block_size 16" in reasons and "not available" in reasons


@needs_no_flash_attn
def test_explicit_selection_fails_with_the_reasons():
    from attnplug.plugins.selection import select_backend

    layer = AttentionLayerConfig(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=16,
                                 device="cuda")
    with pytest.raises(BackendUnsupportedError) as err:
        select_backend(layer, "full_attention", cli_choice="flash_attn")
    assert "flash-attn package is not installed" in str(err.value) and "block_size 16" in str(err.value)


def test_real_backends_are_registered_and_emulators_are_not():
    names = set(get_registry().names())
    assert {"flash_attn", "flashinfer"} <= names
    assert not any("emulated" in n for n in names)
    for cls in (FlashAttn2EmulatedBackend, FlashAttn3EmulatedBackend, FlashInferEmulatedBackend):
        assert cls.get_name() not in names


def test_attnplug_backends_lists_both_with_the_reason_they_are_unavailable():
    from attnplug.runner.commands.backends import backend_rows

    rows = {r["name"]: r for r in backend_rows(get_registry())}
    for name in ("flash_attn", "flashinfer"):
        ok, why = get_registry().get(name).is_available()
        assert rows[name]["available"] is ok and rows[name]["unavailable_reason"] == ("" if ok else why)
        if not torch.cuda.is_available():
            assert not ok and "no CUDA device" in why


def test_an_fa3_build_without_the_varlen_paged_keywords_is_unavailable_with_the_reason(probe_with):
    """Older FA3 builds have flash_attn_with_kvcache without page_table / cu_seqlens_q /
    scheduler_metadata: a clear reason at probe time, not a TypeError at the first forward."""
    import types

    from attnplug.backends.flash_attn import kernels

    old = types.ModuleType("flash_attn_interface")
    old.flash_attn_with_kvcache = lambda q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, causal=False: q
    new = types.ModuleType("flash_attn_interface")
    new.flash_attn_with_kvcache = lambda q, k_cache, v_cache, **kwargs: q  # unreadable: trusted
    for module, available in ((old, False), (new, True)):
        found, why = probe_with(kernels, {"flash_attn_interface": module, "flash_attn": None})
        assert (found is not None) == available, why
        if not available:
            assert "too old" in why and "page_table, cu_seqlens_q, max_seqlen_q" in why, why
