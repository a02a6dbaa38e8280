"""KV-cache write at ``slot_mapping`` and the GPU slot-mapping kernel (Triton interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.triton import compute_slot_mapping, write_kv_cache
from attnplug.cache_groups.block_table import BlockTable
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.errors import MetadataError


@pytest.mark.parametrize("num_kv_heads, head_size", [(2, 32), (1, 80), (8, 128)])
def test_write_lands_exactly_at_the_slots_and_skips_padding(num_kv_heads, head_size):
    g = torch.Generator().manual_seed(1)
    kv_cache = torch.full((6, 2, 16, num_kv_heads, head_size), 1000.0)
    before = kv_cache.clone()
    key = torch.randn(7, num_kv_heads, head_size, generator=g)
    value = torch.randn(7, num_kv_heads, head_size, generator=g)
    slots = torch.tensor([17, PAD_SLOT_ID, 5, 95, 16, PAD_SLOT_ID, 40])
    write_kv_cache(key, value, kv_cache[:, 0], kv_cache[:, 1], slots)
    expected = before.clone()
    real = slots != PAD_SLOT_ID
    s = slots[real]
    expected[s // 16, 0, s % 16] = key[real]
    expected[s // 16, 1, s % 16] = value[real]
    assert torch.equal(kv_cache, expected)


def test_write_casts_to_the_cache_dtype_and_takes_strided_rows():
    kv_cache = torch.zeros(2, 2, 16, 2, 32, dtype=torch.float16)
    qkv = torch.randn(3, 3, 2, 32)  # a fused projection: key/value are strided views
    key, value = qkv[:, 1], qkv[:, 2]
    write_kv_cache(key, value, kv_cache[:, 0], kv_cache[:, 1], torch.tensor([0, 1, 31]))
    assert torch.equal(kv_cache[0, 0, :2], key[:2].half()) and torch.equal(kv_cache[1, 1, 15], value[2].half())


def test_write_rejects_mismatched_shapes_without_writing():
    kv_cache = torch.zeros(2, 2, 16, 2, 32)
    with pytest.raises(MetadataError, match="write_kv_cache"):
        write_kv_cache(torch.ones(3, 1, 32), torch.ones(3, 1, 32), kv_cache[:, 0], kv_cache[:, 1],
                       torch.tensor([0, 1, 2]))
    assert not kv_cache.any()


def test_slot_mapping_worked_example_from_the_design_notes():
    """Block size 4; A computed 5 schedules 1, B computed 0 schedules 3, C computed 8 schedules 2."""
    qsl = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    positions = torch.tensor([5, 0, 1, 2, 8, 9])
    block_table = torch.tensor([[7, 2, 0], [5, 0, 0], [3, 6, 4]], dtype=torch.int32)
    out = torch.zeros(9, dtype=torch.int64)
    got = compute_slot_mapping(qsl, positions, block_table, 4, out, num_reqs=3, num_tokens_padded=8)
    assert got.tolist() == [9, 20, 21, 22, 16, 17, PAD_SLOT_ID, PAD_SLOT_ID]
    assert int(out[8]) == 0, "nothing past num_tokens_padded is written"


def test_slot_mapping_equals_the_runners_numpy_path():
    rng = np.random.default_rng(3)
    block_size, num_reqs, width = 16, 7, 40
    table = BlockTable(block_size, num_reqs, width, 4096)
    computed = rng.integers(0, 300, num_reqs)
    sched = rng.integers(1, 300, num_reqs)
    for r in range(num_reqs):
        n_blocks = -(-int(computed[r] + sched[r]) // block_size)
        table.add_row(rng.permutation(np.arange(1, 1000))[:n_blocks].tolist(), r)
    req_idx = np.repeat(np.arange(num_reqs), sched)
    starts = np.concatenate([[0], np.cumsum(sched)[:-1]])
    positions = computed[req_idx] + np.arange(len(req_idx)) - starts[req_idx]
    want = table.compute_slot_mapping(req_idx, positions.astype(np.int64), num_tokens_padded=len(req_idx) + 5)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(sched)]), dtype=torch.int32)
    out = torch.empty(4096, dtype=torch.int64)
    got = compute_slot_mapping(qsl, torch.as_tensor(positions, dtype=torch.int64),
                               torch.as_tensor(table.block_table_np), block_size, out, num_reqs=num_reqs,
                               num_tokens_padded=len(req_idx) + 5)
    assert torch.equal(got, want)


def test_slot_mapping_validates_before_launching():
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(MetadataError, match="positions must be int64"):
        compute_slot_mapping(qsl, torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 16,
                             torch.empty(2, dtype=torch.int64), num_reqs=1)
    with pytest.raises(MetadataError, match="slot_mapping must be int64 with >= 4 entries"):
        compute_slot_mapping(qsl, torch.tensor([0, 1]), torch.zeros(1, 2, dtype=torch.int32), 16,
                             torch.empty(2, dtype=torch.int64), num_reqs=1, num_tokens_padded=4)
