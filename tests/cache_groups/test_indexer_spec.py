"""``IndexerSpec`` (DeepSeek-V3.2's indexer keys): derived head size, bytes per token, its own
group beside the MLA latent group, the full-attention block policy; bad fields refused."""

from __future__ import annotations

import pytest
import torch

from attnplug.cache_groups.grouping import group_layers_by_spec
from attnplug.cache_groups.indexer_spec import IndexerSpec
from attnplug.cache_groups.kinds import PAGED_FULL_KINDS, GroupKind
from attnplug.cache_groups.specs import MLAAttentionSpec
from attnplug.core.errors import KVCacheSpecError


def test_indexer_spec_is_a_paged_full_kind_with_one_row_per_token():
    s = IndexerSpec(block_size=64, index_head_dim=128, dtype=torch.bfloat16)
    assert s.kind is GroupKind.INDEXER and s.kind in PAGED_FULL_KINDS
    assert (s.head_size, s.num_kv_heads, s.bytes_per_token, s.page_size_bytes) == (128, 1, 256, 64 * 256)
    assert s.max_memory_usage_bytes(max_model_len=130, max_num_batched_tokens=8) == 3 * 64 * 256


def test_indexer_and_latent_layers_form_two_groups():
    latent = MLAAttentionSpec(block_size=16, kv_lora_rank=32, qk_rope_head_dim=16)
    index = IndexerSpec(block_size=16, index_head_dim=32)
    groups = group_layers_by_spec({"a.attn": latent, "a.indexer": index, "b.attn": latent, "b.indexer": index})
    assert [(g.kv_cache_spec.kind.value, g.layer_names) for g in groups] == [
        ("mla", ("a.attn", "b.attn")), ("indexer", ("a.indexer", "b.indexer"))]


@pytest.mark.parametrize("kwargs, words", [
    (dict(index_head_dim=0), "index_head_dim must be a positive int, got 0"),
    (dict(index_head_dim=32, head_size=16), "head_size 16 != index_head_dim 32"),
    (dict(index_head_dim=32, num_kv_heads=2), "num_kv_heads must be 1"),
    (dict(index_head_dim=True), "index_head_dim must be a positive int, got True"),
])
def test_bad_indexer_fields_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(KVCacheSpecError, match=words.replace("(", r"\(")):
        IndexerSpec(block_size=16, **kwargs)
