"""``cpu_sdpa``'s builder, on its SDPA path (no compiled paged kernel, or a spec the kernel does
not take; ``CpuSdpaGatherMetadataBuilder`` forces it), splits full-attention decodes of mixed lengths into length buckets
(``backends/cpu_sdpa/builder.py``): each bucket pads its keys by less than ``1 / BUCKET_RATIO``,
every decode lands in exactly one bucket, and the bucket's mask and hidden rows are the
keys past each request's ``seq_len``. That the bucketed attention equals ``torch_native``'s
(NaN-poisoned free blocks included) is ``test_cpu_sdpa_matches_reference.py``'s ragged cases."""

from __future__ import annotations

import numpy as np
import torch

from attnplug.backends.cpu_sdpa.builder import (
    BUCKET_RATIO,
    CpuSdpaGatherMetadataBuilder,
    DecodeBucket,
    bucket_bounds,
)
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core import BuilderConfig, CommonAttentionMetadata


def test_bucket_bounds_cover_every_length_and_bound_the_padding():
    seq = np.array([600, 590, 400, 300, 299, 150, 60, 47, 3, 3], dtype=np.int64)
    assert bucket_bounds(seq, 0.5) == [(0, 4), (4, 6), (6, 8), (8, 10)]
    assert bucket_bounds(seq, 0.9) == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 8), (8, 10)]
    for start, end in bucket_bounds(seq):
        assert seq[end - 1] >= BUCKET_RATIO * seq[start]


def test_mixed_length_decodes_become_buckets_with_their_masks():
    lens = [40, 3, 17, 38, 9]
    block = 4
    width = max(-(-n // block) for n in lens)
    table = torch.arange(1, 1 + len(lens) * width, dtype=torch.int32).view(len(lens), width)
    cm = CommonAttentionMetadata.from_lengths([n - 1 for n in lens], [1] * len(lens), table, block)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8)
    md = CpuSdpaGatherMetadataBuilder(spec, ["l0"], BuilderConfig(len(lens), 64, 64), "cpu").build(0, cm)
    assert all(isinstance(s, DecodeBucket) for s in md.segments) and len(md.segments) == 3
    rows = sorted(r for s in md.segments for r in s.req_indices.tolist())
    assert rows == list(range(len(lens)))
    for s in md.segments:
        seq = s.seq_lens.tolist()
        assert s.max_seq_len == max(seq) and min(seq) >= BUCKET_RATIO * max(seq)
        visible = torch.arange(s.max_seq_len)[None, :] < s.seq_lens[:, None]
        assert torch.equal(s.key_mask.view(len(seq), -1), visible)
        width_b = s.key_block_ids.shape[1] * block
        hidden = [r * width_b + c for r, n in enumerate(seq) for c in range(n, s.max_seq_len)]
        assert s.hidden_rows.tolist() == hidden
        for r, req in enumerate(s.req_indices.tolist()):  # each request's own blocks, in order
            nb = -(-seq[r] // block)
            assert s.key_block_ids[r, :nb].tolist() == table[req, :nb].tolist()
