"""The sparse builders' per-token key ranges: a decode sees its whole request, a prefill
chunk's query j with c cached tokens sees c + j + 1 keys, padding rows see none; positions
map to slots through each group's own block table (-1 stays -1); the modules' doctests."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

from attnplug.backends.sparse.common import SelectorMetadataBuilder, positions_to_slots, token_ranges
from attnplug.cache_groups.indexer_spec import IndexerSpec
from attnplug.core.constants import PAD_SLOT_ID
from attnplug.core.contracts import BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata


def test_decode_and_prefill_chunk_ranges_and_padding():
    cm = CommonAttentionMetadata.from_lengths([6, 2], [1, 3], [[1, 2], [3, 4]], 4)
    pad = torch.full((2,), PAD_SLOT_ID, dtype=torch.int64)
    cm = cm.replace(slot_mapping=torch.cat([cm.slot_mapping, pad]))
    r = token_ranges(cm)
    assert r.key_end.tolist() == [7, 3, 4, 5, 0, 0] and r.key_start.tolist() == [0] * 6
    assert r.req_of_token.tolist() == [0, 1, 1, 1, 0, 0] and r.max_key_len == 7


def test_positions_map_through_the_block_table_and_minus_one_stays():
    table = torch.tensor([[5, 2], [7, 1]], dtype=torch.int32)
    slots = positions_to_slots(torch.tensor([[0, 5, -1], [4, -1, 3]]), torch.tensor([0, 1]), table, 4)
    assert slots.tolist() == [[20, 9, -1], [4, -1, 31]]


def test_every_build_is_a_fresh_object():
    cm = CommonAttentionMetadata.from_lengths([3], [2], [[1, 2]], 4)
    b = SelectorMetadataBuilder(IndexerSpec(block_size=4, index_head_dim=16), ["i"], BuilderConfig(2, 8, 32), "cpu")
    one, two = b.build(0, cm), b.build(0, cm)
    assert one is not two and one.ranges.key_end.tolist() == [4, 5]


@pytest.mark.parametrize("module", ["attnplug.cache_groups.indexer_spec", "attnplug.backends.sparse.torch_native.backend",
                                    "attnplug.backends.sparse.triton.backend", "attnplug.backends.sparse.flashmla.backend"])
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0
