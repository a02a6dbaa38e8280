"""The compiled paged kernel (``backends/cpu_sdpa/paged.py``) equals ``torch_native`` on random
paged layouts, and refuses what it cannot read.

Hypothesis draws a step (decodes, speculative rows, fresh prompts, chunked-prefill
continuations), a shuffled block table with NaN-poisoned free blocks and garbage past each
request's blocks, the head shape (GQA/MQA/MHA, head sizes 8..256), a sliding window and a
soft-cap; both backends run the step through the attnplug contract (builder + impl) and
``cpu_sdpa`` must have called the kernel once when ``builder.kernel_takes`` gives it a request
(or the layer is soft-capped), never the reference path; and the kernel alone, on every row
(the prompts the backend gives SDPA included), matches too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnplug.backends.cpu_sdpa import CpuSdpaBackend, paged
from attnplug.backends.cpu_sdpa.builder import kernel_takes
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.torch_native.impl import TorchNativeAttentionImpl
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core import BuilderConfig, CommonAttentionMetadata
from attnplug.core.errors import MetadataError

pytestmark = pytest.mark.skipif(not paged.available(), reason="the compiled paged kernel is not built")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@st.composite
def layouts(draw):
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 8]))
    head_size = draw(st.sampled_from([8, 32, 64, 72, 128, 256]))
    block_size = draw(st.sampled_from([1, 3, 4, 16, 32]))
    step = draw(st.lists(st.tuples(st.integers(0, 70), st.sampled_from([1, 1, 1, 2, 4, 9, 40])), min_size=1,
                         max_size=6))
    window = draw(st.sampled_from([None, None, 1, 5, 33]))
    cap = draw(st.sampled_from([None, None, 3.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2 ** 16))
    return num_kv_heads * group, num_kv_heads, head_size, block_size, step, window, cap, dtype, seed


def _inputs(num_heads, num_kv_heads, head_size, block_size, step, window, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = [c + s for c, s in step]
    need = [-(-n // block_size) for n in lens]
    width = max(need) + 2
    num_blocks = sum(need) + 4
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()  # block 0: the null block
    table = torch.randint(0, num_blocks, (len(step), width), generator=gen, dtype=torch.int32)  # garbage past
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = ids[used:used + n]
        used += n
    cm = CommonAttentionMetadata.from_lengths([c for c, _ in step], [s for _, s in step], table, block_size)
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    kv[0] = float("nan")
    kv[ids[used:].long()] = float("nan")  # free blocks
    if window is None:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    else:
        spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                                 sliding_window=window)
    T = sum(s for _, s in step)
    qkv = [torch.randn(T, h, head_size, generator=gen).to(dtype) for h in (num_heads, num_kv_heads, num_kv_heads)]
    return cm, spec, kv, qkv, len(step)


def _forward(backend, num_heads, num_kv_heads, head_size, window, cap, cm, spec, kv, qkv, num_reqs):
    """``(output, metadata, kv cache after the write)`` of one forward through ``backend``."""
    builder = backend.get_builder_cls()(spec, ["l0"], BuilderConfig(num_reqs, 512, 512), "cpu")
    impl = backend.get_impl_cls()(num_heads, head_size, head_size ** -0.5, num_kv_heads, sliding_window=window,
                                  logits_soft_cap=cap)
    out, kv, md = torch.full_like(qkv[0], float("nan")), kv.clone(), builder.build(0, cm)
    return impl.forward(None, *qkv, kv, md, out), md, kv


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_kernel_matches_torch_native_on_random_paged_layouts(layout):
    num_heads, num_kv_heads, head_size, block_size, step, window, cap, dtype, seed = layout
    args = _inputs(num_heads, num_kv_heads, head_size, block_size, step, window, dtype, seed)
    expected = _forward(TorchNativeBackend, num_heads, num_kv_heads, head_size, window, cap, *args)[0]
    calls, real, real_native = [0], paged.paged_attention_checked, TorchNativeAttentionImpl.forward

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    def no_fallback(*a, **kw):
        raise AssertionError("cpu_sdpa fell back to the torch_native path")

    paged.paged_attention_checked, TorchNativeAttentionImpl.forward = counted, no_fallback
    try:
        got, md, kv = _forward(CpuSdpaBackend, num_heads, num_kv_heads, head_size, window, cap, *args)
    finally:
        paged.paged_attention_checked, TorchNativeAttentionImpl.forward = real, real_native
    on_kernel = any(kernel_takes(s, c + s, head_size, dtype) for c, s in step)
    assert calls[0] == (on_kernel or cap is not None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])
    # the kernel alone on every row (the prompts the backend gives SDPA included)
    alone = paged.paged_attention(torch.full_like(got, float("nan")), args[3][0], kv, md.block_table_tensor,
                                  md.query_start_loc, md.seq_lens, md.paged_all_reqs, scale=head_size ** -0.5,
                                  sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(alone.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_threads_split_the_work_without_changing_the_result():
    args = _inputs(8, 2, 64, 16, [(30, 1), (5, 9), (0, 20), (64, 1)], None, torch.float32, 3)
    cm, spec, kv, qkv, n = args
    builder = CpuSdpaBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(n, 512, 512), "cpu")
    impl = CpuSdpaBackend.get_impl_cls()(8, 64, 0.125, 2)
    md = builder.build(0, cm)
    impl.forward(None, *qkv, kv, md, torch.empty_like(qkv[0]))  # writes this step's K/V
    outs = [paged.paged_attention(torch.empty_like(qkv[0]), qkv[0], kv, md.block_table_tensor, md.query_start_loc,
                                  md.seq_lens, md.paged_all_reqs, scale=0.125, num_threads=t) for t in (1, 2)]
    assert torch.equal(outs[0], outs[1])


def test_bad_inputs_are_refused_before_the_kernel_reads():
    cm, spec, kv, qkv, n = _inputs(4, 2, 16, 4, [(6, 1), (0, 3)], None, torch.float32, 0)
    md = CpuSdpaBackend.get_builder_cls()(spec, ["l0"], BuilderConfig(n, 64, 64), "cpu").build(0, cm)
    q = qkv[0]
    ok = dict(scale=0.25)
    bad = [
        ((q, q, kv, md.block_table_tensor.long(), md.query_start_loc, md.seq_lens, md.paged_reqs), "block_table"),
        ((q, q, kv, md.block_table_tensor, md.query_start_loc.long(), md.seq_lens, md.paged_reqs), "query_start_loc"),
        ((q, q, kv.half(), md.block_table_tensor, md.query_start_loc, md.seq_lens, md.paged_reqs), "KV cache dtype"),
        ((q, q.transpose(0, 2).contiguous().transpose(0, 2), kv, md.block_table_tensor, md.query_start_loc,
          md.seq_lens, md.paged_reqs), "contiguous last dim"),
        ((q, q, kv.to(torch.float8_e4m3fn), md.block_table_tensor, md.query_start_loc, md.seq_lens, md.paged_reqs),
         "KV cache dtype"),
    ]
    for call, word in bad:
        with pytest.raises(ValueError, match=word):
            paged.paged_attention(*call, **ok)
    impl = CpuSdpaBackend.get_impl_cls()(4, 16, 0.25, 2)
    small = kv[:int(md.max_block_id)]  # one block short of the table's largest id
    with pytest.raises(MetadataError, match="names block"):
        impl.forward(None, *qkv, small, md, torch.empty_like(q))


def test_unsupported_layers_fall_back_with_a_reason(monkeypatch):
    assert paged.unsupported(torch.float32, torch.float32, 64) is None
    assert "head size" in paged.unsupported(torch.float32, torch.float32, 20)
    assert "head size" in paged.unsupported(torch.float32, torch.float32, 264)
    assert "KV cache dtype" in paged.unsupported(torch.float32, torch.float8_e5m2, 64)
    assert "dtype" in paged.unsupported(torch.float64, torch.float64, 64)
    assert "causal" in paged.unsupported(torch.float32, torch.float32, 64, causal=False, sliding_window=4)
    monkeypatch.setenv(paged.ENV_SWITCH, "0")
    assert "turned off" in paged.unsupported(torch.float32, torch.float32, 64)


_WIDTH_CASES = [  # (H, H_kv, head size, block size, step, window, soft-cap, dtype)
    (8, 2, 32, 32, [(320, 1), (100, 1), (63, 1), (64, 1), (0, 3)], None, None, torch.float32),  # tiny-llama
    (9, 3, 64, 16, [(200, 1), (129, 4), (5, 8)], None, None, torch.float32),  # SmolLM2, speculative rows
    (6, 2, 32, 16, [(150, 1), (40, 3)], None, None, torch.float32),  # head size 32, groups of 3: one-row logits
    (8, 1, 128, 3, [(70, 2), (33, 1)], 33, 3.0, torch.bfloat16),
    (4, 2, 256, 4, [(90, 1), (10, 5)], 5, None, torch.float16),
]


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("case", _WIDTH_CASES, ids=lambda c: f"{c[0]}:{c[1]}x{c[2]}-b{c[3]}-{c[7]}")
def test_both_vector_widths_match_torch_native(lanes, case):
    """The 16-lane (AVX-512) item functions and the 8-lane ones (what a CPU without
    AVX-512 runs; forced here) each match the reference, 64-key chunk edges included."""
    num_heads, num_kv_heads, head_size, block_size, step, window, cap, dtype = case
    if dtype not in paged._DTYPE_CODES:
        pytest.skip(f"{dtype} is not compiled in")
    if lanes == 16 and paged._paged.vector_lanes(head_size) != 16:
        pytest.skip("this CPU has no AVX-512: the kernel runs 8 lanes only")
    args = _inputs(num_heads, num_kv_heads, head_size, block_size, step, window, dtype, 11)
    expected = _forward(TorchNativeBackend, num_heads, num_kv_heads, head_size, window, cap, *args)[0]
    _, md, kv = _forward(CpuSdpaBackend, num_heads, num_kv_heads, head_size, window, cap, *args)
    paged._paged._force_8_lanes(lanes == 8)
    try:
        assert paged._paged.vector_lanes(head_size) == lanes
        got = paged.paged_attention(torch.full_like(expected, float("nan")), args[3][0], kv, md.block_table_tensor,
                                    md.query_start_loc, md.seq_lens, md.paged_all_reqs, scale=head_size ** -0.5,
                                    sliding_window=window, logits_soft_cap=cap)
    finally:
        paged._paged._force_8_lanes(False)
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])
