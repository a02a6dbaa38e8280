"""``runner.execute.kv_caches``: kernel block sizes negotiated per group, caches allocated
per layer (shapes, dtypes, kernel-block split, Mamba state slots, errors), and
``ModelRunner`` using exactly those helpers."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.mamba2.backend import Mamba2Backend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.grouping import KVCacheConfig, KVCacheGroupSpec
from attnplug.cache_groups.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from attnplug.core.errors import BackendUnsupportedError, KVCacheSpecError
from attnplug.core.mamba import MambaStateCache
from attnplug.runner.execute.kv_caches import (
    allocate_kv_caches,
    kernel_kv_cache_spec,
    negotiate_kernel_block_sizes,
)
from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig


class Paged16or32(TorchNativeBackend):
    """Pages by 16 or 32 tokens only; HND inside a block."""

    supported_kernel_block_sizes = (16, 32)

    @classmethod
    def get_name(cls) -> str:
        return "paged16or32"

    @classmethod
    def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, num_kv_heads, block_size, head_size)


class LiesAboutKernelSize(TorchNativeBackend):
    @classmethod
    def get_name(cls) -> str:
        return "liar"

    @classmethod
    def get_supported_kernel_block_size(cls, block_size):
        return block_size - 1


def config(*specs, num_blocks=5, num_state_slots=None) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, tuple(KVCacheGroupSpec((f"g{g}.a", f"g{g}.b"), s) for g, s in enumerate(specs)),
                         num_state_slots=num_state_slots)


FULL64 = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=8, dtype=torch.float16)
SLIDE48 = SlidingWindowSpec(block_size=48, num_kv_heads=1, head_size=4, dtype=torch.bfloat16, sliding_window=20)
MAMBA = MambaSpec(block_size=256, conv_state_shape=(6, 3), ssm_state_shape=(2, 4, 5))


def test_negotiate_picks_the_largest_dividing_kernel_size():
    kv = config(FULL64, SLIDE48, FullAttentionSpec(block_size=32))
    assert negotiate_kernel_block_sizes(kv, [Paged16or32] * 3) == [32, 16, 32]
    assert negotiate_kernel_block_sizes(kv, [TorchNativeBackend] * 3) == [64, 48, 32]  # any size: the manager's


def test_negotiate_errors_name_the_group():
    kv = config(FULL64, FullAttentionSpec(block_size=24))
    with pytest.raises(BackendUnsupportedError, match=r"'paged16or32' cannot serve for cache group 1") as e:
        negotiate_kernel_block_sizes(kv, [Paged16or32, Paged16or32])
    assert "block_size 24" in str(e.value) and "[16, 32]" in str(e.value)
    with pytest.raises(BackendUnsupportedError, match="does not divide"):
        negotiate_kernel_block_sizes(kv, [TorchNativeBackend, LiesAboutKernelSize])
    with pytest.raises(KVCacheSpecError, match="1 backends for 2 cache groups"):
        negotiate_kernel_block_sizes(kv, [TorchNativeBackend])


def test_kernel_spec_changes_only_the_block_size():
    assert kernel_kv_cache_spec(FULL64, 64) is FULL64
    k = kernel_kv_cache_spec(SLIDE48, 16)
    assert (type(k), k.block_size, k.sliding_window, k.dtype, k.num_kv_heads) == (SlidingWindowSpec, 16, 20,
                                                                                   torch.bfloat16, 1)


def test_allocate_splits_manager_blocks_into_kernel_blocks():
    kv = config(FULL64, SLIDE48, num_blocks=5)
    backends = [Paged16or32, TorchNativeBackend]
    kbs = negotiate_kernel_block_sizes(kv, backends)
    assert kbs == [32, 48]
    caches = allocate_kv_caches(kv, backends, kbs, "cpu")
    assert list(caches) == ["g0.a", "g0.b", "g1.a", "g1.b"]
    # group 0: 5 manager blocks of 64 = 10 kernel blocks of 32, the backend's own (HND) layout
    assert caches["g0.a"].shape == (10, 2, 2, 32, 8) and caches["g0.a"].dtype == torch.float16
    assert caches["g1.a"].shape == (5, 2, 48, 1, 4) and caches["g1.a"].dtype == torch.bfloat16
    for name, t in caches.items():
        assert t.device == torch.device("cpu") and not t.any(), name
        assert t.numel() * t.element_size() == 5 * kv.groups[int(name[1])].kv_cache_spec.page_size_bytes
    assert caches["g0.a"].data_ptr() != caches["g0.b"].data_ptr()  # one tensor per layer


def test_allocate_mamba_group_gets_state_slots():
    kv = config(FULL64, MAMBA, num_blocks=7, num_state_slots=3)
    backends = [TorchNativeBackend, Mamba2Backend]
    caches = allocate_kv_caches(kv, backends, negotiate_kernel_block_sizes(kv, backends))
    assert caches["g0.a"].shape == (7, 2, 64, 2, 8)
    state = caches["g1.b"]
    assert isinstance(state, MambaStateCache)
    assert state.conv_state.shape == (3, 6, 3) and state.ssm_state.shape == (3, 2, 4, 5)
    assert state.ssm_state.dtype == torch.float32
    with pytest.raises(BackendUnsupportedError, match=r"(?s)cache group 1.*not a MambaBackend"):
        allocate_kv_caches(kv, [TorchNativeBackend, TorchNativeBackend], [64, 256])


@pytest.mark.parametrize("kbs, match", [([64], "1 kernel block sizes for 2 cache groups"),
                                        ([64, 32], "kernel block size 32 does not divide the block size 48"),
                                        ([64, 0], "kernel block size 0"),
                                        ([64, 4.0], "kernel block size 4.0")])
def test_allocate_rejects_bad_kernel_block_sizes(kbs, match):
    with pytest.raises(KVCacheSpecError, match=match):
        allocate_kv_caches(config(FULL64, SLIDE48), [TorchNativeBackend] * 2, kbs)


def test_model_runner_negotiates_and_allocates_through_the_helpers():
    kv = config(FULL64, SLIDE48, num_blocks=4)
    backends = [Paged16or32, Paged16or32]
    runner = ModelRunner(torch.nn.Module(), kv, backends, RunnerConfig(2, 128, 16))
    assert runner.kernel_block_sizes == [32, 16] == runner.compiler.kernel_block_sizes
    expected = allocate_kv_caches(kv, backends, [32, 16])
    assert {n: (t.shape, t.dtype) for n, t in runner.kv_caches.items()} == \
        {n: (t.shape, t.dtype) for n, t in expected.items()}
    # the builders see kernel blocks
    assert [b.kv_cache_spec.block_size for b in runner.metadata_builder.builders] == [32, 16]
    with pytest.raises(BackendUnsupportedError, match="cache group 1"):
        ModelRunner(torch.nn.Module(), config(FULL64, FullAttentionSpec(block_size=24)), backends,
                    RunnerConfig(2, 128, 16))
