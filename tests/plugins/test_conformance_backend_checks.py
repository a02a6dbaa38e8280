"""The backend-level conformance checks have teeth: a builder that re-plans one shared
FlashInfer wrapper on every build (the old flashinfer builder) fails the re-entrancy case
naming the case and step; a backend whose ``kv_cache_layout`` descriptor disagrees with its
``get_kv_cache_shape`` / ``split_kv_cache`` fails the layout check naming the field; the
built-in backends that run on a CPU pass both."""

from __future__ import annotations

import pytest

from attnplug.backends.emulators import FlashAttn2EmulatedBackend, FlashAttn3EmulatedBackend, \
    FlashInferEmulatedBackend
from attnplug.backends.emulators.backends import FlashInferEmulatedBuilder
from attnplug.backends.flash_attn import FlashAttnBackend
from attnplug.backends.flashinfer import FlashInferBackend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.core.kv_layout import KVCacheLayout
from attnplug.plugins.conformance.backend_checks import check_kv_layout, check_reentrant


class _OneWrapperBuilder(FlashInferEmulatedBuilder):
    """Plans the same wrapper for every build (what flashinfer's builder did before)."""

    def _free_wrapper(self, wkey, make):
        pool = self._wrappers.setdefault(wkey, [])
        if not pool:
            pool.append(make())
        self._claimed.append(pool[0])
        return pool[0]


class _OneWrapperBackend(FlashInferEmulatedBackend):
    @classmethod
    def get_builder_cls(cls):
        return _OneWrapperBuilder


def test_a_builder_sharing_one_plan_fails_the_reentrancy_case():
    problems = check_reentrant(_OneWrapperBackend, "cpu")
    assert problems and problems[0].startswith("case 'reentrant_builds', step 0: built before 2 later build(s)"), \
        problems


@pytest.mark.parametrize("backend", [TorchNativeBackend, FlashAttn3EmulatedBackend, FlashAttn2EmulatedBackend,
                                     FlashInferEmulatedBackend], ids=lambda b: b.get_name())
def test_cpu_builders_are_reentrant(backend):
    assert check_reentrant(backend, "cpu") == []


class _WrongLayout(TorchNativeBackend):
    """Declares FlashAttention's K/V-outermost order but allocates the default one."""

    kv_cache_layout = KVCacheLayout(dims=("kv", "block", "token", "head", "dim"))

    @classmethod
    def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


class _WrongSplit(TorchNativeBackend):
    """Shape as declared, but the halves swapped (K read from the V slot)."""

    @classmethod
    def split_kv_cache(cls, kv_cache):
        return kv_cache[:, 1], kv_cache[:, 0]


def test_a_layout_descriptor_that_disagrees_with_the_shape_fails_naming_the_field():
    (problem,) = check_kv_layout(_WrongLayout)
    assert "kv_cache_layout.dims ('kv', 'block', 'token', 'head', 'dim')" in problem
    assert "dimension 0: get_kv_cache_shape gives 5, kv_cache_layout.dims says 'kv' (2)" in problem


def test_split_views_that_disagree_with_the_descriptor_fail():
    problems = check_kv_layout(_WrongSplit)
    assert len(problems) == 2 and "split_kv_cache's K half" in problems[0], problems


@pytest.mark.parametrize("backend", [TorchNativeBackend, FlashAttnBackend, FlashInferBackend],
                         ids=lambda b: b.get_name())
def test_builtin_layouts_match_their_descriptors(backend):
    assert check_kv_layout(backend) == []


def test_flashinfer_wrappers_stay_held_by_a_copy_of_the_metadata():
    """A wrapper returns to the pool when its plan is dropped, not when one metadata object is:
    a ``dataclasses.replace`` copy (sharing the plans) keeps it."""
    import dataclasses

    import torch

    from attnplug.cache_groups.specs import FullAttentionSpec
    from attnplug.core.contracts import BuilderConfig
    from attnplug.core.metadata import CommonAttentionMetadata

    impl = FlashInferEmulatedBackend.get_impl_cls()(4, 16, 0.25, 2)  # noqa: F841 (planned while alive)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16)
    builder = FlashInferEmulatedBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(2, 16, 64), "cpu")
    cm = CommonAttentionMetadata.from_lengths([5, 0], [1, 6], [[1, 2], [3, 4]], block_size=16)
    md = builder.build(0, cm)
    copy = dataclasses.replace(md, slot_mapping=md.slot_mapping.clone())
    del md
    builder.build(0, cm)  # the copy holds the first wrappers: a second set is made
    assert all(len(pool) == 2 for pool in builder._wrappers.values())
    del copy
    builder.build(0, cm)  # now the first set is free again
    assert all(len(pool) == 2 for pool in builder._wrappers.values())
    assert torch.is_tensor(builder._workspace)
