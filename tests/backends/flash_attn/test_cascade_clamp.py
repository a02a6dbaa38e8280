"""The flash_attn builder clamps a cascade's shared prefix to the shortest request context.

``build(common_prefix_len, ...)`` may be given a prefix longer than some request's
``num_computed_tokens`` (the shared blocks hold that request's own query tokens too). The
prefix part of cascade attention is non-causal, so the builder must cut it to the
smallest ``num_computed_tokens`` of the real requests (padded rows do not count), then
round down to whole blocks. Each case asks for a prefix that needs the clamp, checks the
fields and compares the emulated FA3 result with torch_native."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.emulators import FlashAttn3EmulatedBackend
from attnplug.backends.emulators.testing import make_paged_batch, torch_native_reference
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.contracts import BuilderConfig
from attnplug.runner.execute.cudagraph import PaddedMetadata

BLOCK = 4


def _setup(b):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=b.num_kv_heads, head_size=b.head_size,
                             dtype=b.key_cache.dtype)
    backend = FlashAttn3EmulatedBackend
    builder = backend.get_builder_cls()(spec, ["l0"], BuilderConfig(8, 64, 256), "cpu")
    impl = backend.get_impl_cls()(b.num_heads, b.head_size, b.head_size ** -0.5, b.num_kv_heads)
    return builder, impl


def _forward(impl, b, md):
    kv = torch.stack([b.key_cache, b.value_cache])
    out = torch.zeros_like(b.query)
    impl.forward(None, b.query, b.key, b.value, kv, md, out)
    return out


@pytest.mark.parametrize("computed, scheduled, asked, want", [
    ([12, 9, 10], [1, 2, 3], 12, 8),    # shortest context 9 (not the first row): 9 -> 8
    ([13, 16, 12], [2, 1, 1], 16, 12),  # shortest context 12, exactly 3 blocks: kept whole
    ([14, 13, 15], [1, 1, 2], 99, 12),  # far more than any request holds
], ids=["mid_row_shortest", "exact_blocks", "huge"])
def test_prefix_is_clamped_to_the_shortest_context(computed, scheduled, asked, want):
    shared = asked // BLOCK if asked < 99 else 3
    b = make_paged_batch(computed, scheduled, block_size=BLOCK, seed=5, shared_prefix_blocks=shared)
    builder, impl = _setup(b)
    md = builder.build(asked, b.cm)
    c = md.cascade
    assert c is not None and c.common_prefix_len == want
    assert c.prefix_kv_lens.tolist() == [want] and c.cu_prefix_kv_lens.tolist() == [0, want]
    assert c.prefix_block_table.tolist() == [b.block_ids[0][:want // BLOCK]]
    seq = [x + s for x, s in zip(computed, scheduled)]
    assert c.suffix_kv_lens.tolist() == [n - want for n in seq]
    assert c.max_suffix_kv_len == max(seq) - want
    for r, ids in enumerate(b.block_ids):
        assert c.suffix_block_table[r].tolist()[:len(ids) - want // BLOCK] == ids[want // BLOCK:]
    torch.testing.assert_close(_forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_a_request_with_less_than_a_block_of_context_turns_cascade_off():
    b = make_paged_batch([12, 3, 10], [1, 1, 1], block_size=BLOCK, seed=6, shared_prefix_blocks=1)
    builder, impl = _setup(b)
    md = builder.build(8, b.cm)
    assert md.cascade is None  # min(8, 3) = 3 < one block
    torch.testing.assert_close(_forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)


def test_padded_requests_do_not_count_as_the_shortest():
    """A CUDA-graph step pads requests with empty ones (num_computed_tokens 0): the clamp
    reads the real requests only."""
    b = make_paged_batch([12, 9, 10], [1, 1, 1], block_size=BLOCK, seed=7, shared_prefix_blocks=3)
    (padded,) = PaddedMetadata(8, "cpu").pad([b.cm], 4)
    assert padded.num_computed_tokens_cpu.tolist() == [12, 9, 10, 0]
    builder, impl = _setup(b)
    md = builder.build(12, padded)
    assert md.cascade is not None and md.cascade.common_prefix_len == 8
    assert md.cascade.suffix_kv_lens.tolist() == [5, 2, 3, 0]
    torch.testing.assert_close(_forward(impl, b, md), torch_native_reference(b), atol=1e-5, rtol=1e-5)
