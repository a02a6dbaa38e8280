"""Where ``cpu_sdpa`` attends a prompt, and the SDPA path's fresh-prompt slices.

* ``builder.kernel_takes``: at most 8 query tokens always on the paged kernel; longer
  requests on it in float32 while ``seq_len`` <= 1,024 (continuations at head size <= 32:
  any length), never in bfloat16 / float16
  (docs/performance.md, "Prefill on the paged kernel (issue 38, session 13)");
* the builder routes a step's requests that way (``paged_reqs`` / ``sdpa_segments``), a
  prompt with no earlier context that stays on SDPA as a ``FreshPrefill`` (its token rows),
  a continuation, a prompt with an unwritten (``PAD_SLOT_ID``) row or a sliding-window
  group's prompt as a gathered segment;
* a ``FreshPrefill`` runs SDPA over slices of the step's K/V (the gather is not called)
  and matches ``torch_native`` on both routes (kernel metadata, the SDPA-only backend), at
  rows not starting at 0; a prompt with an unwritten row reads the cache as the reference.
"""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.cpu_sdpa import CpuSdpaBackend, paged
from attnplug.backends.cpu_sdpa.backend import CpuSdpaGatherBackend
from attnplug.backends.cpu_sdpa.builder import FreshPrefill, kernel_takes
from attnplug.backends.cpu_sdpa.impl import CpuSdpaAttentionImpl
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.core import BuilderConfig, CommonAttentionMetadata
from attnplug.core.constants import PAD_SLOT_ID
from tests.backends.cpu_sdpa.test_paged_kernel_matches_reference import _inputs

needs_kernel = pytest.mark.skipif(not paged.available(), reason="the compiled paged kernel is not built")

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 40, 16  # head size > 32: continuations past 1,024 keys on SDPA
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def test_kernel_takes_short_rows_always_and_float32_prompts_up_to_1024_keys():
    f32, bf16 = torch.float32, torch.bfloat16
    assert kernel_takes(8, 100_000, 64, bf16) and kernel_takes(8, 100_000, 64, f32)
    assert kernel_takes(9, 1024, 64, f32) and kernel_takes(1000, 1024, 64, f32) and kernel_takes(1024, 1024, 32, f32)
    assert not kernel_takes(9, 1025, 64, f32) and not kernel_takes(1025, 1025, 64, f32)
    # past 1,024 keys: head size <= 32 continuations only
    assert kernel_takes(512, 4608, 32, f32) and not kernel_takes(1025, 1025, 32, f32)
    assert not kernel_takes(512, 4608, 64, f32)
    assert not kernel_takes(9, 9, 64, bf16) and not kernel_takes(9, 9, 32, torch.float16)


def _step(step, dtype=torch.float32, window=None, pad_rows=(), seed=0, head_size=HEAD_SIZE):
    """``(common metadata, spec, kv cache, (q, k, v))`` of ``step`` = [(context, query_len)]
    (``test_paged_kernel_matches_reference._inputs``: shuffled blocks, NaN in the free ones);
    ``pad_rows``: token rows given ``PAD_SLOT_ID``."""
    cm, spec, kv, qkv, _ = _inputs(HEADS, KV_HEADS, head_size, BLOCK, step, window, dtype, seed)
    if pad_rows:
        slots = cm.slot_mapping.clone()
        slots[list(pad_rows)] = PAD_SLOT_ID
        cm = CommonAttentionMetadata(**{**cm.__dict__, "slot_mapping": slots})
    return cm, spec, kv, tuple(qkv)


def _forward(backend, cm, spec, kv, qkv, window=None):
    builder = backend.get_builder_cls()(spec, ["l0"], BuilderConfig(cm.num_reqs, 4096, 4096), "cpu")
    d = spec.head_size
    impl = backend.get_impl_cls()(HEADS, d, d ** -0.5, KV_HEADS, sliding_window=window)
    md = builder.build(0, cm)
    out = torch.full_like(qkv[0], float("nan"))
    return impl.forward(None, *qkv, kv.clone(), md, out), md


@needs_kernel
def test_builder_routes_each_request_by_kernel_takes():
    # decodes, a float32 fresh prompt and a continuation within 1,024 keys, a fresh prompt and
    # a continuation past it
    step = [(40, 1), (0, 30), (200, 50), (0, 1030), (1000, 30)]
    cm, spec, kv, qkv = _step(step)
    md = _forward(CpuSdpaBackend, cm, spec, kv, qkv)[1]
    assert sorted(md.paged_reqs.tolist()) == [0, 1, 2]
    by_req = {int(seg.req_indices[0]): seg for seg in md.sdpa_segments}
    assert sorted(by_req) == [3, 4]
    assert isinstance(by_req[3], FreshPrefill) and by_req[3].token_start == 1 + 30 + 50
    assert not isinstance(by_req[4], FreshPrefill)
    # head size 32 or less: the continuation past 1,024 keys on the kernel too, not the prompt
    cm, spec, kv, qkv = _step(step, head_size=16)
    md = _forward(CpuSdpaBackend, cm, spec, kv, qkv)[1]
    assert sorted(md.paged_reqs.tolist()) == [0, 1, 2, 4]
    assert [int(seg.req_indices[0]) for seg in md.sdpa_segments] == [3]
    # bfloat16: every request with more than 8 query tokens on SDPA, the fresh one on slices
    cm, spec, kv, qkv = _step([(40, 1), (0, 30), (200, 50), (5, 8)], dtype=torch.bfloat16)
    md = _forward(CpuSdpaBackend, cm, spec, kv, qkv)[1]
    assert sorted(md.paged_reqs.tolist()) == [0, 3]
    kinds = {int(seg.req_indices[0]): type(seg) for seg in md.sdpa_segments}
    assert kinds[1] is FreshPrefill and kinds[2] is not FreshPrefill


@needs_kernel
def test_no_fresh_prefill_for_an_unwritten_row_or_a_window():
    cm, spec, kv, qkv = _step([(0, 1030)], pad_rows=(7,))
    md = _forward(CpuSdpaBackend, cm, spec, kv, qkv)[1]
    assert len(md.sdpa_segments) == 1 and not isinstance(md.sdpa_segments[0], FreshPrefill)
    cm, spec, kv, qkv = _step([(0, 30)], dtype=torch.bfloat16, window=16)
    md = _forward(CpuSdpaBackend, cm, spec, kv, qkv, window=16)[1]
    assert len(md.sdpa_segments) == 1 and not isinstance(md.sdpa_segments[0], FreshPrefill)


def _count_gathers(monkeypatch):
    calls = []
    real = CpuSdpaAttentionImpl._attend_segment

    def counted(self, query, kv_cache, md, seg, *a, **kw):
        calls.append(seg)
        return real(self, query, kv_cache, md, seg, *a, **kw)

    monkeypatch.setattr(CpuSdpaAttentionImpl, "_attend_segment", counted)
    return calls


@pytest.mark.parametrize("backend,step,dtype", [
    pytest.param(CpuSdpaBackend, [(40, 1), (3, 20), (0, 1030)], torch.float32, marks=needs_kernel, id="kernel-f32"),
    pytest.param(CpuSdpaBackend, [(40, 1), (3, 20), (0, 37)], torch.bfloat16, marks=needs_kernel, id="kernel-bf16"),
    pytest.param(CpuSdpaGatherBackend, [(40, 1), (3, 20), (0, 37), (0, 12)], torch.float32, id="sdpa-only"),
])
def test_fresh_prompts_attend_slices_of_the_step_and_match_torch_native(monkeypatch, backend, step, dtype):
    cm, spec, kv, qkv = _step(step, dtype=dtype)
    expected = _forward(TorchNativeBackend, cm, spec, kv, qkv)[0]
    gathered = _count_gathers(monkeypatch)
    got, md = _forward(backend, cm, spec, kv, qkv)
    fresh = [seg for seg in (md.sdpa_segments if md.paged_reqs is not None else md.segments)
             if isinstance(seg, FreshPrefill)]
    assert fresh and not [seg for seg in gathered if isinstance(seg, FreshPrefill)]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


@needs_kernel
def test_a_prompt_with_an_unwritten_row_reads_the_cache_like_torch_native():
    cm, spec, kv, qkv = _step([(0, 1030)], pad_rows=(5,))
    kv[kv.isnan()] = 0.5  # the unwritten row's slot holds what the cache held: finite here
    expected = _forward(TorchNativeBackend, cm, spec, kv, qkv)[0]
    got = _forward(CpuSdpaBackend, cm, spec, kv, qkv)[0]
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
