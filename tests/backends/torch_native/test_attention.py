"""torch_native attention against a deliberately naive dense reference.

The reference (``naive_attention``) never touches the paged cache: it keeps each
request's whole K/V history as a plain tensor and, per request and per head, builds the
explicit ``[query_len, seq_len]`` mask matrix with Python loops, in float64.

Tolerances (max abs error against the float64 reference, inputs of magnitude ~1):
float32 1e-5 (float32 accumulation); float16 2e-3 and bfloat16 2e-2 (the float32 result is
rounded to the output dtype: relative steps 2^-11 and 2^-8).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attnplug.backends import BUILTIN_BACKENDS
from attnplug.backends.torch_native import TorchNativeBackend, TorchNativeMetadata
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    AttentionCGSupport,
    AttentionLayerConfig,
    BackendUnsupportedError,
    BuilderConfig,
    CommonAttentionMetadata,
    MetadataError,
    UnknownBackendError,
)
from attnplug.plugins import get_backend

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
POISON = float("nan")


def naive_attention(q, k, v, num_computed, scale, window=None, softcap=None, causal=True):
    """One request: q [q_len, H, D]; k, v [seq_len, H_kv, D] (all of its keys), float64."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    mask = torch.zeros(q_len, seq_len, dtype=torch.bool)
    for j in range(q_len):
        p = num_computed + j
        for key_pos in range(seq_len):
            visible = key_pos <= p or not causal
            if window is not None:
                visible = visible and key_pos > p - window
            mask[j, key_pos] = visible
    out = torch.empty(q_len, num_heads, q.shape[-1], dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        logits = q[:, h].double() @ kh.T * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~mask, -math.inf)
        out[:, h] = torch.softmax(logits, dim=-1) @ vh
    return out


class Case:
    """A batch: per request its context length, query length and full random K/V history."""

    def __init__(self, num_computed, query_lens, num_heads=4, num_kv_heads=2, head_size=8,
                 block_size=4, dtype=torch.float32, window=None, softcap=None, seed=0,
                 null_out_of_window=False, q_scale=1.0, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.device = device
        self.c, self.q_lens = list(num_computed), list(query_lens)
        self.seq_lens = [c + q for c, q in zip(self.c, self.q_lens)]
        self.H, self.H_kv, self.D, self.B = num_heads, num_kv_heads, head_size, block_size
        self.dtype, self.window, self.softcap = dtype, window, softcap
        self.scale = head_size ** -0.5
        rand = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
        self.q = [(rand(n, num_heads, head_size).float() * q_scale).to(dtype) for n in self.q_lens]
        self.k = [rand(s, num_kv_heads, head_size) for s in self.seq_lens]
        self.v = [rand(s, num_kv_heads, head_size) for s in self.seq_lens]
        # Permuted, non-contiguous physical blocks (block 0 is the reserved null block).
        blocks_per_req = [-(-s // block_size) for s in self.seq_lens]
        self.num_blocks = 1 + sum(blocks_per_req) + 3
        perm = (torch.randperm(self.num_blocks - 1, generator=g) + 1).tolist()
        width = max(blocks_per_req) + 1
        self.block_table = []
        for n in blocks_per_req:
            row, perm = perm[:n], perm[n:]
            self.block_table.append(row + [NULL_BLOCK_ID] * (width - n))
        if null_out_of_window:  # what a sliding-window manager does: free blocks no query sees
            for i, c in enumerate(self.c):
                skippable = max(0, c - window + 1)
                for b in range(skippable // block_size):
                    self.block_table[i][b] = NULL_BLOCK_ID
        self.kv_cache = torch.full((self.num_blocks, 2, block_size, num_kv_heads, head_size), POISON,
                                   dtype=dtype, device=device)
        for i, c in enumerate(self.c):  # the context K/V was written by earlier steps
            for pos in range(c):
                blk = self.block_table[i][pos // block_size]
                if blk != NULL_BLOCK_ID:
                    self.kv_cache[blk, 0, pos % block_size] = self.k[i][pos]
                    self.kv_cache[blk, 1, pos % block_size] = self.v[i][pos]

    def spec(self):
        if self.window is None:
            return FullAttentionSpec(self.B, self.H_kv, self.D, self.dtype)
        return SlidingWindowSpec(self.B, self.H_kv, self.D, self.dtype, sliding_window=self.window)

    def common(self):
        return CommonAttentionMetadata.from_lengths(self.c, self.q_lens, self.block_table, self.B,
                                                    device=self.device)

    def new_tokens(self):
        """Flat ``query``, ``key``, ``value`` of this step's tokens."""
        return (torch.cat(self.q).to(self.device),
                torch.cat([k[c:] for k, c in zip(self.k, self.c)]).to(self.device),
                torch.cat([v[c:] for v, c in zip(self.v, self.c)]).to(self.device))

    def builder(self):
        cls = TorchNativeBackend.get_builder_cls()
        return cls(self.spec(), ["layer.0"], BuilderConfig(8, 256, 256), self.device)

    def impl(self):
        return TorchNativeBackend.get_impl_cls()(self.H, self.D, self.scale, self.H_kv,
                                                 sliding_window=self.window, logits_soft_cap=self.softcap)

    def run(self, metadata=None):
        md = metadata or self.builder().build(0, self.common())
        q, k, v = self.new_tokens()
        out = torch.zeros_like(q)
        return self.impl().forward(None, q, k, v, self.kv_cache, md, out)

    def expected(self, causal=True):
        return torch.cat([naive_attention(self.q[i], self.k[i], self.v[i], self.c[i], self.scale,
                                          self.window, self.softcap, causal) for i in range(len(self.c))])


def check(case, out=None, causal=True):
    out = case.run() if out is None else out
    err = (out.double().cpu() - case.expected(causal)).abs().max().item()
    assert err <= TOL[case.dtype], f"max abs error {err} > {TOL[case.dtype]} for {case.dtype}"


@pytest.mark.parametrize("num_computed,query_lens", [
    ([0], [7]),                      # single prefill
    ([0, 0, 0], [5, 1, 9]),          # batch of prefills (one of length 1)
    ([7, 12, 3], [1, 1, 1]),         # decodes
    ([0, 5, 9, 2], [6, 1, 3, 1]),    # mixed prefill / decode / continuation
], ids=["prefill", "prefills", "decode", "mixed"])
def test_matches_naive_reference(num_computed, query_lens):
    check(Case(num_computed, query_lens))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_gqa_mqa(num_heads, num_kv_heads):
    check(Case([3, 0, 10], [2, 6, 1], num_heads=num_heads, num_kv_heads=num_kv_heads))


@pytest.mark.parametrize("block_size,head_size", [(1, 8), (3, 24), (16, 80)])
def test_any_block_size_and_head_size(block_size, head_size):
    check(Case([4, 0, 17], [3, 8, 1], block_size=block_size, head_size=head_size))


def test_chunked_prefill_continuation_through_the_cache():
    """The second chunk reads the first chunk's K/V from the cache the impl itself wrote."""
    full = Case([0, 0], [11, 6], seed=3)
    first = [5, 2]
    k_all, v_all, q_all = full.k, full.v, full.q
    # Step 1: the first chunk of each prompt.
    full.c, full.q_lens = [0, 0], first
    full.q = [q[:n] for q, n in zip(q_all, first)]
    full.k, full.v = [k[:n] for k, n in zip(k_all, first)], [v[:n] for v, n in zip(v_all, first)]
    full.seq_lens = first
    out1 = full.run()
    # Step 2: the rest, attending to chunk 1 through the paged cache.
    full.c, full.q_lens = first, [11 - 5, 6 - 2]
    full.q = [q[n:] for q, n in zip(q_all, first)]
    full.k, full.v, full.seq_lens = k_all, v_all, [11, 6]
    out2 = full.run()
    ref = [naive_attention(q_all[i], k_all[i], v_all[i], 0, full.scale) for i in range(2)]
    got = [torch.cat([out1[:5], out2[:6]]), torch.cat([out1[5:], out2[6:]])]
    for g, r in zip(got, ref):
        assert (g.double() - r).abs().max().item() <= TOL[torch.float32]


@pytest.mark.parametrize("window", [5, 1, 100], ids=["W5-not-multiple-of-block", "W1", "W-larger-than-seq"])
def test_sliding_window(window):
    check(Case([0, 9, 13, 3], [12, 1, 4, 2], window=window))


def test_sliding_window_never_reads_freed_null_blocks():
    """Blocks before the window are the null block (full of NaN): output stays exact."""
    case = Case([13, 22, 9], [1, 3, 2], window=5, block_size=4, null_out_of_window=True)
    assert any(NULL_BLOCK_ID in row[:2] for row in case.block_table)
    out = case.run()
    assert torch.isfinite(out).all()
    check(case, out)


def test_logits_soft_cap():
    case = Case([0, 6], [9, 2], softcap=5.0, q_scale=8.0)
    check(case)
    plain = Case([0, 6], [9, 2], softcap=None, q_scale=8.0)
    assert (case.run() - plain.run()).abs().max() > 1e-2  # the cap actually bites


def test_window_and_softcap_together_with_mqa():
    check(Case([2, 11], [7, 1], num_heads=4, num_kv_heads=1, window=3, softcap=2.0, q_scale=4.0))


@pytest.mark.parametrize("window", [None, 4])
def test_query_tiling_does_not_change_results(monkeypatch, window):
    """Long queries are attended in tiles of QUERY_TILE_TOKENS with a trimmed key range."""
    import attnplug.backends.torch_native.impl as impl_mod
    monkeypatch.setattr(impl_mod, "QUERY_TILE_TOKENS", 3)
    check(Case([0, 6, 2, 9], [10, 1, 8, 1], window=window, softcap=3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    case = Case([0, 4, 9], [6, 1, 3], dtype=dtype, window=6)
    out = case.run()
    assert out.dtype == dtype and case.kv_cache.dtype == dtype
    check(case, out)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def test_cache_writes_only_real_slots_and_padding_is_untouched():
    case = Case([3, 0], [2, 5], block_size=4)
    before = case.kv_cache.clone()
    common = case.common()
    num_pad = 3
    padded = common.replace(slot_mapping=torch.cat(
        [common.slot_mapping, torch.full((num_pad,), PAD_SLOT_ID, dtype=torch.int64)]))
    md = case.builder().build(0, padded)
    q, k, v = case.new_tokens()
    q = torch.cat([q, torch.randn(num_pad, case.H, case.D)])
    k = torch.cat([k, torch.randn(num_pad, case.H_kv, case.D)])
    v = torch.cat([v, torch.randn(num_pad, case.H_kv, case.D)])
    out = torch.full_like(q, 7.0)
    case.impl().forward(None, q, k, v, case.kv_cache, md, out)
    assert (out[-num_pad:] == 7.0).all(), "padded output rows must be left untouched"
    check(case, out[:-num_pad])
    written = torch.zeros(case.num_blocks, case.B, dtype=torch.bool)
    for i, s in enumerate(case.seq_lens):
        for pos in range(s):
            written[case.block_table[i][pos // case.B], pos % case.B] = True
    changed = (_bits(case.kv_cache) != _bits(before)).flatten(3).any(-1).any(1)  # [blocks, block_size]
    assert not (changed & ~written).any(), "bytes outside real slots changed"


def test_pad_slot_inside_real_tokens_is_not_written():
    """A real token row whose slot is PAD_SLOT_ID writes nothing (not slot -1 = the last one)."""
    case = Case([0], [4], block_size=4)
    common = case.common()
    slots = common.slot_mapping.clone()
    skipped = int(slots[-1])
    slots[-1] = PAD_SLOT_ID
    md = case.builder().build(0, common.replace(slot_mapping=slots))
    before = case.kv_cache.clone()
    q, k, v = case.new_tokens()
    case.impl().forward(None, q, k, v, case.kv_cache, md, torch.zeros_like(q))
    assert torch.equal(_bits(case.kv_cache[-1]), _bits(before[-1])), "last block was written through -1"
    blk, off = divmod(skipped, case.B)
    assert torch.isnan(case.kv_cache[blk, :, off]).all()


def test_builder_never_mutates_common_metadata_and_update_block_table():
    case = Case([2, 0, 5], [1, 4, 3], block_size=2)
    common = case.common()
    snapshot = {f.name: (v.clone() if isinstance(v := getattr(common, f.name), torch.Tensor) else v)
                for f in dataclasses.fields(common)}
    builder = case.builder()
    md = builder.build(0, common)
    for name, old in snapshot.items():
        new = getattr(common, name)
        assert (torch.equal(old, new) if isinstance(old, torch.Tensor) else old == new), name
    assert isinstance(md, TorchNativeMetadata)
    assert builder.cudagraph_support == AttentionCGSupport.NEVER and builder.supports_update_block_table
    # Another group with the same spec, whose blocks live elsewhere: same answer.
    other = Case([2, 0, 5], [1, 4, 3], block_size=2, seed=0)
    perm = torch.randperm(other.num_blocks - 1, generator=torch.Generator().manual_seed(9)) + 1
    remap = torch.cat([torch.tensor([NULL_BLOCK_ID]), perm])
    other.kv_cache = torch.full_like(case.kv_cache, POISON)
    other.kv_cache[remap] = case.kv_cache.clone()
    other.block_table = remap[torch.tensor(case.block_table)].tolist()
    other_common = other.common()
    md_blocks_before = md.segments[0].key_block_ids.clone()
    md2 = builder.update_block_table(md, other_common.block_table_tensor, other_common.slot_mapping)
    assert torch.equal(md.segments[0].key_block_ids, md_blocks_before), "update_block_table mutated its input"
    check(other, other.run(md2))
    check(case, case.run(md))


def test_forward_rejects_mismatched_inputs():
    case = Case([0], [3])
    md = case.builder().build(0, case.common())
    q, k, v = case.new_tokens()
    with pytest.raises(MetadataError, match="kv_cache"):
        case.impl().forward(None, q, k, v, case.kv_cache[:, :, :2], md, torch.zeros_like(q))
    with pytest.raises(MetadataError, match="TorchNativeMetadata"):
        case.impl().forward(None, q, k, v, case.kv_cache, case.common(), torch.zeros_like(q))
    with pytest.raises(MetadataError, match="key"):
        case.impl().forward(None, q, k[:, :1], v, case.kv_cache, md, torch.zeros_like(q))
    with pytest.raises(MetadataError, match="kv_cache must be floating point"):
        case.impl().forward(None, q, k, v, torch.zeros(case.kv_cache.shape, dtype=torch.int64), md, torch.zeros_like(q))


def test_builder_rejects_short_block_table():
    case = Case([0], [9], block_size=4)
    common = case.common()
    short = common.replace(block_table_tensor=common.block_table_tensor[:, :2])
    with pytest.raises(MetadataError, match="blocks of 4 tokens"):
        case.builder().build(0, short)


def test_impl_rejects_bad_heads():
    with pytest.raises(BackendUnsupportedError, match="multiple of num_kv_heads"):
        TorchNativeBackend.get_impl_cls()(6, 8, 1.0, 4)


def test_capabilities_and_lookup():
    assert get_backend("torch_native") is TorchNativeBackend and "torch_native" in BUILTIN_BACKENDS
    with pytest.raises(UnknownBackendError, match="torch_native"):
        get_backend("nope")
    assert TorchNativeBackend.features() == {"sliding_window": True, "logits_soft_cap": True, "mqa_gqa": True,
                                             "sinks": True, "alibi": True, "alibi_sqrt": False, "non_causal": False,
                                             "lse_return": False, "batch_invariant": False}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cfg = AttentionLayerConfig(num_heads=8, num_kv_heads=2, head_size=72, dtype=dtype, block_size=5,
                                   sliding_window=7, logits_soft_cap=30.0)
        assert TorchNativeBackend.validate_configuration(cfg) == []
    bad = AttentionLayerConfig(num_heads=8, num_kv_heads=3, head_size=64, dtype=torch.float64)
    assert len(TorchNativeBackend.validate_configuration(bad)) == 2


def test_non_causal_sees_every_key_of_its_request():
    case = Case([4, 0], [3, 5])
    md = case.builder().build(0, case.common().replace(causal=False))
    check(case, case.run(md), causal=False)


def test_empty_batch_builds_and_runs():
    case = Case([0], [2])
    common = CommonAttentionMetadata.from_lengths([], [], torch.zeros(0, 1, dtype=torch.int64), case.B)
    md = case.builder().build(0, common)
    assert md.segments == () and md.write_slots.numel() == 0
    q = torch.zeros(0, case.H, case.D)
    kv = torch.zeros(0, case.H_kv, case.D)
    assert case.impl().forward(None, q, kv, kv, case.kv_cache, md, q.clone()).shape == (0, case.H, case.D)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference_without_host_syncs(dtype):
    """On CUDA the builder may sync; forward must not (sync debug mode turns syncs into errors)."""
    case = Case([0, 5, 9, 300], [6, 1, 3, 1], window=4, softcap=3.0, dtype=dtype, device="cuda",
                null_out_of_window=True)
    md = case.builder().build(0, case.common())
    q, k, v = case.new_tokens()
    out = torch.zeros_like(q)
    impl = case.impl()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        impl.forward(None, q, k, v, case.kv_cache, md, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device.type == "cuda"
    check(case, out)
