"""torch_native on a sliding-window group reads only the live window's blocks.

For a :class:`SlidingWindowSpec` group the builder starts each request's key range at the
first block its first query can see (the blocks before it were freed by the pool), so a
decode reads at most ``cdiv(W, B) + 1`` blocks whatever its length, and poisoning every
block outside the window (NaN, or a freed block reused by another request) changes
nothing.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.sliding_window import num_skipped_blocks
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec, cdiv
from attnplug.core import NULL_BLOCK_ID, BuilderConfig, CommonAttentionMetadata, MetadataError

H, H_KV, D = 4, 2, 8


def reference(q, k, v, start, window, scale):
    """float64 dense attention of one request: queries at ``start ..``, keys ``0 .. len(k)-1``."""
    pos_q = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    pos_k = torch.arange(k.shape[0]).unsqueeze(0)
    mask = (pos_k <= pos_q) & (pos_k > pos_q - window)
    group = H // H_KV
    out = torch.empty(q.shape[0], H, D, dtype=torch.float64)
    for h in range(H):
        logits = q[:, h].double() @ k[:, h // group].double().T * scale
        out[:, h] = torch.softmax(logits.masked_fill(~mask, -math.inf), -1) @ v[:, h // group].double()
    return out


class Batch:
    """Requests with long histories in a paged cache; blocks before each window are freed
    (null in the block table) and their old physical blocks poisoned."""

    def __init__(self, num_computed, query_lens, window, block_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.c, self.q_lens, self.W, self.B = list(num_computed), list(query_lens), window, block_size
        self.seq = [c + q for c, q in zip(self.c, self.q_lens)]
        self.q = [torch.randn(n, H, D, generator=g) for n in self.q_lens]
        self.k = [torch.randn(s, H_KV, D, generator=g) for s in self.seq]
        self.v = [torch.randn(s, H_KV, D, generator=g) for s in self.seq]
        nblk = [cdiv(s, block_size) for s in self.seq]
        num_blocks = 1 + sum(nblk)
        perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        width = max(nblk)
        self.table, self.freed = [], []
        for i, n in enumerate(nblk):
            row, perm = perm[:n], perm[n:]
            skipped = num_skipped_blocks(self.c[i], window, block_size)
            self.freed += row[:skipped]
            self.table.append([NULL_BLOCK_ID] * skipped + row[skipped:] + [NULL_BLOCK_ID] * (width - n))
        self.kv = torch.zeros(num_blocks, 2, block_size, H_KV, D)
        for i, c in enumerate(self.c):
            for pos in range(c):
                b = self.table[i][pos // block_size]
                if b != NULL_BLOCK_ID:
                    self.kv[b, 0, pos % block_size], self.kv[b, 1, pos % block_size] = self.k[i][pos], self.v[i][pos]

    def builder(self, spec=None):
        spec = spec or SlidingWindowSpec(self.B, H_KV, D, sliding_window=self.W)
        return TorchNativeBackend.get_builder_cls()(spec, ["l"], BuilderConfig(8, 4096, 4096), "cpu")

    def metadata(self, spec=None):
        cm = CommonAttentionMetadata.from_lengths(self.c, self.q_lens, self.table, self.B)
        return self.builder(spec).build(0, cm)

    def run(self, md):
        q = torch.cat(self.q)
        k = torch.cat([k[c:] for k, c in zip(self.k, self.c)])
        v = torch.cat([v[c:] for v, c in zip(self.v, self.c)])
        impl = TorchNativeBackend.get_impl_cls()(H, D, D ** -0.5, H_KV, sliding_window=self.W)
        return impl.forward(None, q, k, v, self.kv, md, torch.zeros_like(q))

    def expected(self):
        return torch.cat([reference(q, k, v, c, self.W, D ** -0.5)
                          for q, k, v, c in zip(self.q, self.k, self.v, self.c)])


@pytest.mark.parametrize("W,B", [(20, 8), (5, 4), (16, 16), (1, 4)])
def test_decode_reads_o_window_keys_not_o_sequence(W, B):
    b = Batch([3000, 1500, 17, 999], [1, 1, 1, 1], W, B)
    md = b.metadata()
    (seg,) = md.segments
    key_slots = seg.key_block_ids.shape[1] * B
    assert key_slots <= (cdiv(W, B) + 1) * B  # O(W), whatever the sequence length (3001 here)
    assert not (seg.key_block_ids == NULL_BLOCK_ID).all(dim=1).any()
    # every block handed to the kernel for a request is live (never a freed one)
    assert not set(seg.key_block_ids.flatten().tolist()) & set(b.freed)
    assert (b.run(md).double() - b.expected()).abs().max() <= 1e-5


def test_full_attention_spec_keeps_the_whole_history():
    b = Batch([300, 40], [1, 1], 20, 8)
    (seg,) = b.metadata(FullAttentionSpec(8, H_KV, D)).segments
    assert seg.key_block_ids.shape[1] == cdiv(301, 8) and seg.max_key_offset == 0


def test_poisoning_blocks_outside_the_window_changes_nothing():
    """Mixed decodes and chunked-prefill continuations: NaN in every freed block, and in the
    live blocks' slots before each request's window, gives bit-identical output."""
    W, B = 11, 4
    b = Batch([200, 37, 5, 64], [1, 9, 3, 1], W, B, seed=1)
    md = b.metadata()
    clean = b.run(md)
    assert (clean.double() - b.expected()).abs().max() <= 1e-5
    for blk in b.freed:
        b.kv[blk] = float("nan")
    b.kv[NULL_BLOCK_ID] = float("nan")
    for i, c in enumerate(b.c):  # slots of live blocks that no query of this step sees
        for pos in range(max(0, c - W + 1)):
            blk = b.table[i][pos // B]
            if blk != NULL_BLOCK_ID:
                b.kv[blk, :, pos % B] = float("nan")
    assert torch.equal(b.run(md), clean)


def test_prefill_chunk_key_range_starts_at_its_first_querys_window():
    W, B = 10, 4
    b = Batch([50], [7], W, B)
    (seg,) = b.metadata().segments
    assert int(seg.key_offsets[0]) == num_skipped_blocks(50, W, B) * B == 40
    assert seg.key_block_ids.shape[1] == cdiv(57, B) - 10


def test_layer_window_larger_than_the_groups_is_rejected():
    b = Batch([40], [1], 8, 4)
    md = b.metadata()
    q, k = torch.randn(1, H, D), torch.randn(1, H_KV, D)
    impl = TorchNativeBackend.get_impl_cls()(H, D, D ** -0.5, H_KV, sliding_window=None)
    with pytest.raises(MetadataError, match="window"):
        impl.forward(None, q, k, k, b.kv, md, torch.zeros_like(q))


def test_update_block_table_keeps_the_window_start():
    b = Batch([100, 30], [1, 4], 12, 4)
    md = b.metadata()
    cm = CommonAttentionMetadata.from_lengths(b.c, b.q_lens, b.table, b.B)
    other = torch.tensor(b.table, dtype=torch.int32)
    reused = b.builder().update_block_table(md, other, cm.slot_mapping)
    for s0, s1 in zip(md.segments, reused.segments):
        assert torch.equal(s0.key_block_ids, s1.key_block_ids) and torch.equal(s0.key_offsets, s1.key_offsets)
