"""cpu_sdpa's C K/V write (backends/cpu_sdpa/kv_write.py) leaves the cache byte for byte as
torch_native's reference write does, on the fused-projection views the models hand it, and
refuses a bad slot or token index before writing anything."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.cpu_sdpa import kv_write
from attnplug.backends.torch_native.attention import write_to_paged_cache
from attnplug.core.errors import MetadataError

pytestmark = pytest.mark.skipif(not kv_write.available(), reason="backends/cpu_sdpa/_kv_write.pyx not built")

NUM_BLOCKS, BLOCK, HEADS_KV, HEAD = 7, 4, 2, 16


def _step(dtype, num_tokens=9, seed=0):
    """(key, value) as column views of one fused [T, (4 + 2 * H_kv) * D] projection, a
    poisoned cache, and a write plan: distinct slots, a subset of the tokens in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (4 + 2 * HEADS_KV) * HEAD, generator=g).to(dtype)
    k_lo = 4 * HEAD
    key = qkv[:, k_lo:k_lo + HEADS_KV * HEAD].view(num_tokens, HEADS_KV, HEAD)
    value = qkv[:, k_lo + HEADS_KV * HEAD:].view(num_tokens, HEADS_KV, HEAD)
    cache = torch.randn(NUM_BLOCKS, 2, BLOCK, HEADS_KV, HEAD, generator=g).to(dtype)
    tokens = torch.randperm(num_tokens, generator=g)[:num_tokens - 2]
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:tokens.shape[0]]
    return key, value, cache, slots, tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_c_write_equals_the_reference_write_byte_for_byte(dtype):
    key, value, cache, slots, tokens = _step(dtype)
    want = cache.clone()
    write_to_paged_cache(key, value, want, slots, tokens)
    assert kv_write.write(key, value, cache, slots, tokens)
    assert torch.equal(cache.view(torch.uint8) if dtype != torch.float32 else cache.view(torch.int32),
                       want.view(torch.uint8) if dtype != torch.float32 else want.view(torch.int32))


@pytest.mark.parametrize("bad", ["slot_high", "slot_negative", "token_high", "token_negative"])
def test_a_bad_index_is_refused_and_the_cache_is_unchanged(bad):
    key, value, cache, slots, tokens = _step(torch.float32)
    slots, tokens = slots.clone(), tokens.clone()
    last = slots.shape[0] - 1  # every write before it is valid: none of them may land
    if bad == "slot_high":
        slots[last] = NUM_BLOCKS * BLOCK
    elif bad == "slot_negative":
        slots[last] = -1
    elif bad == "token_high":
        tokens[last] = key.shape[0]
    else:
        tokens[last] = -1
    before = cache.clone()
    with pytest.raises(MetadataError, match=f"write {last} has slot"):
        kv_write.write(key, value, cache, slots, tokens)
    assert torch.equal(cache, before)


def test_layouts_it_does_not_take_are_left_to_the_torch_write():
    key, value, cache, slots, tokens = _step(torch.float32)
    before = cache.clone()
    strided_cache = torch.zeros(NUM_BLOCKS, 2, BLOCK, HEADS_KV, 2 * HEAD)[..., :HEAD]
    assert not kv_write.write(key, value, strided_cache, slots, tokens)
    assert not kv_write.write(key.transpose(1, 2).contiguous().transpose(1, 2), value, cache, slots, tokens)
    assert not kv_write.write(key.half(), value.half(), cache, slots, tokens)  # a dtype the cache does not hold
    assert not kv_write.write(key, value, cache, slots.int(), tokens)
    assert torch.equal(cache, before)
