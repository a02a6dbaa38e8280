"""CommonAttentionMetadata: from_lengths (the docstring example), replace, dtypes."""

from __future__ import annotations

import dataclasses
import doctest

import pytest
import torch

import attnplug.core.metadata as metadata_mod
from attnplug.core.errors import MetadataError
from attnplug.core.metadata import CommonAttentionMetadata


def seed_metadata() -> CommonAttentionMetadata:
    # the seed's example: block size 4; A computed 5 (+1), B 0 (+3), C 8 (+2)
    return CommonAttentionMetadata.from_lengths(
        num_computed_tokens=[5, 0, 8], num_scheduled_tokens=[1, 3, 2],
        block_table=[[1, 2, 0], [5, 0, 0], [3, 6, 4]], block_size=4, num_prompt_tokens=[6, 5, 10])


def test_module_doctests_pass():
    result = doctest.testmod(metadata_mod)
    assert result.attempted >= 1 and result.failed == 0


def test_from_lengths_docstring_example():
    m = CommonAttentionMetadata.from_lengths(
        num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [5, 0]], block_size=4)
    assert m.query_start_loc.tolist() == [0, 1, 4]
    assert m.seq_lens.tolist() == [6, 3]
    assert m.slot_mapping.tolist() == [9, 20, 21, 22]


def test_from_lengths_seed_example_fields_and_dtypes():
    m = seed_metadata()
    assert m.query_start_loc.tolist() == [0, 1, 4, 6] and m.query_start_loc.dtype == torch.int32
    assert m.query_start_loc_cpu.tolist() == [0, 1, 4, 6]
    assert m.seq_lens.tolist() == [6, 3, 10] and m.seq_lens.dtype == torch.int32
    assert m.num_computed_tokens_cpu.tolist() == [5, 0, 8]
    assert m.positions.tolist() == [5, 0, 1, 2, 8, 9] and m.positions.dtype == torch.int64
    assert m.slot_mapping.tolist() == [9, 20, 21, 22, 16, 17] and m.slot_mapping.dtype == torch.int64
    assert m.block_table_tensor.dtype == torch.int32
    assert (m.num_reqs, m.num_actual_tokens, m.max_query_len, m.max_seq_len) == (3, 6, 3, 10)
    assert m.causal is True
    assert m.is_prefilling.tolist() == [True, True, True]
    assert m.query_lens_cpu.tolist() == [1, 3, 2]


def test_replace_makes_a_per_group_copy_sharing_the_rest():
    m = seed_metadata()
    bt2 = torch.tensor([[7, 0, 0], [8, 0, 0], [9, 10, 11]], dtype=torch.int32)
    sm2 = torch.arange(6, dtype=torch.int64)
    g1 = m.replace(block_table_tensor=bt2, slot_mapping=sm2)
    assert g1 is not m
    assert g1.block_table_tensor is bt2 and g1.slot_mapping is sm2
    assert g1.query_start_loc is m.query_start_loc and g1.positions is m.positions
    assert m.slot_mapping.tolist() == [9, 20, 21, 22, 16, 17]  # the template is untouched
    for f in dataclasses.fields(m):  # every other field is the template's own object
        if f.name not in ("block_table_tensor", "slot_mapping"):
            assert getattr(g1, f.name) is getattr(m, f.name), f.name
    g1.num_reqs = 99  # a copy, not a view of the template's fields
    assert m.num_reqs == 3 and g1 == dataclasses.replace(g1)
    with pytest.raises(TypeError, match="not_a_field"):
        m.replace(block_table_tensor=bt2, not_a_field=1)
    assert m.block_table_tensor is not bt2
    m.note = "a memo"  # an attribute besides the fields: not carried, as dataclasses.replace
    g2 = m.replace(num_reqs=2)
    assert not hasattr(g2, "note") and g2.num_reqs == 2 and g2.positions is m.positions


def test_replace_of_a_subclass_keeps_the_subclass_and_runs_its_post_init():
    @dataclasses.dataclass
    class Tagged(CommonAttentionMetadata):
        tag: str = "a"

        def __post_init__(self):
            self.tag = self.tag.upper()

    base = seed_metadata()
    t = Tagged(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, tag="x")
    t2 = t.replace(tag="y", num_reqs=2)
    assert type(t2) is Tagged and t2.tag == "Y" and t2.num_reqs == 2 and t.tag == "X"


def test_from_lengths_rejects_mismatched_inputs():
    with pytest.raises(MetadataError, match="must agree"):
        CommonAttentionMetadata.from_lengths([1, 2], [1], [[1], [2]], 4)
    with pytest.raises(MetadataError, match="enough blocks"):
        CommonAttentionMetadata.from_lengths([4], [1], [[1]], 4)
