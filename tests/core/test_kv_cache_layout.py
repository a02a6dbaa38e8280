"""A backend's cache layout is one declaration (``kv_cache_layout``): the shape and the K/V
views the runner, the suite and debugging tools use follow from it."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.flash_attn import FlashAttnBackend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.core.kv_layout import KVCacheLayout


@pytest.mark.parametrize("dims", [("block", "kv", "token", "head", "dim"), ("kv", "block", "token", "head", "dim"),
                                  ("block", "kv", "head", "token", "dim")], ids=["NHD", "FA", "HND"])
def test_split_views_are_the_nhd_halves_of_the_cache(dims):
    layout = KVCacheLayout(dims=dims)
    cache = torch.zeros(layout.shape(3, 4, 2, 8))
    k, v = layout.split(cache)
    assert k.shape == v.shape == (3, 4, 2, 8)
    k[1, 2, 1] = 1.0  # block 1, token 2, head 1: a view, so the write lands in the cache
    v[2, 0, 0] = 2.0
    index = {"block": 1, "kv": 0, "token": 2, "head": 1}
    assert cache[tuple(index[d] for d in dims[:4])].sum() == 8.0 and cache.sum() == 8.0 + 16.0


def test_backends_declare_their_layout():
    assert TorchNativeBackend.get_kv_cache_shape(5, 16, 2, 64) == (5, 2, 16, 2, 64)
    assert FlashAttnBackend.get_kv_cache_shape(5, 16, 2, 64) == (2, 5, 16, 2, 64)
    cache = torch.arange(2 * 5 * 16 * 2 * 4).view(FlashAttnBackend.get_kv_cache_shape(5, 16, 2, 4))
    k, v = FlashAttnBackend.split_kv_cache(cache)
    assert k.is_contiguous() and torch.equal(v, cache[1])


def test_a_layout_that_is_not_a_permutation_is_refused():
    with pytest.raises(ValueError, match="permutation"):
        KVCacheLayout(dims=("block", "token", "head", "dim"))
    with pytest.raises(ValueError, match="scales"):
        KVCacheLayout(scales="cache")
