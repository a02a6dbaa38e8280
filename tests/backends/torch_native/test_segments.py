"""The torch_native builder's segments against their definitions, field by field, on
random steps (all-decode, mixed, sliding window): the vectorised lowering (``segments.py``)
gives every prefill row its token rows, positions, key offset and key blocks, the decode
segment its rows, and ``update_block_table`` re-reads the same columns of another table."""

from __future__ import annotations

import numpy as np
import pytest

from attnplug.backends.torch_native import TorchNativeMetadataBuilder
from attnplug.cache_groups.sliding_window import num_skipped_blocks
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec, cdiv
from attnplug.core import NULL_BLOCK_ID, BuilderConfig, CommonAttentionMetadata

B, W = 4, 6


def _step(rng, n, all_decode):
    q = np.ones(n, dtype=np.int64) if all_decode else rng.choice([1, 1, 2, 5, 9], size=n)
    c = rng.integers(0, 30, size=n)
    width = cdiv(int((c + q).max()), B) + 2
    table = rng.integers(1, 500, size=(n, width)).tolist()
    return CommonAttentionMetadata.from_lengths(c.tolist(), q.tolist(), table, block_size=B), q, c + q


@pytest.mark.parametrize("window", [None, W])
@pytest.mark.parametrize("all_decode", [True, False])
def test_segments_match_their_definitions(window, all_decode):
    spec = SlidingWindowSpec(B, 2, 8, sliding_window=W) if window else FullAttentionSpec(B, 2, 8)
    builder = TorchNativeMetadataBuilder(spec, ["l"], BuilderConfig(16, 256, 128), "cpu")
    rng = np.random.default_rng(3)
    for _ in range(12):
        cm, q, s = _step(rng, int(rng.integers(1, 9)), all_decode)
        md = builder.build(0, cm)
        other = cm.block_table_tensor.flip(1).contiguous()
        reused = builder.update_block_table(md, other, cm.slot_mapping)
        qsl = np.concatenate([[0], np.cumsum(q)])
        seen = []
        for seg, seg2 in zip(md.segments, reused.segments):
            rows = seg.req_indices.tolist()
            seen += rows
            assert (q[rows] == seg.query_len).all() and (seg.query_len == 1 or len(rows) == 1)
            assert seg.seq_lens.tolist() == s[rows].tolist() and seg.max_seq_len == s[rows].max()
            assert seg.min_seq_len == s[rows].min()
            for r, i in enumerate(rows):
                first = 0 if window is None else num_skipped_blocks(int(s[i] - q[i]), W, B)
                assert seg.query_token_indices[r].tolist() == list(range(qsl[i], qsl[i + 1]))
                assert seg.query_positions[r].tolist() == list(range(s[i] - q[i], s[i]))
                assert int(seg.key_offsets[r]) == first * B
                live = cdiv(int(s[i]), B) - first
                for s_, table in ((seg, cm.block_table_tensor), (seg2, other)):
                    ids = s_.key_block_ids[r].tolist()
                    assert ids[:live] == table[i, first:first + live].tolist()
                    assert all(x in (NULL_BLOCK_ID, *table[i].tolist()) for x in ids[live:])
        assert sorted(seen) == list(range(len(q)))
