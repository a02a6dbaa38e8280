"""The triton backend compiled on a CUDA GPU (marker ``gpu``; skipped without CUDA).

* the conformance suite on CUDA: the built-in catalog (float32/float16/bfloat16) plus
  ``cases_triton.json`` — float16 and bfloat16 at realistic sizes (head sizes 64/128/256,
  block 16 and 64, contexts to 8k, 256-request decode batches, chunked mixed batches,
  sliding window, soft-cap); ``forward`` runs under ``torch.cuda.set_sync_debug_mode("error")``;
* CUDA graphs: a step captured once replays correctly for new batches of the same shape
  written into the builder's persistent buffers (unified and split-KV paths);
* the kernels against a dense float32 reference at long contexts (split-KV, windows);
* the GPU slot-mapping kernel against the runner's numpy path.

Run them in a process without ``TRITON_INTERPRET`` (``tests/gpu/run_all.sh`` does).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]
pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
DEV = "cuda"


@pytest.fixture(autouse=True)
def compiled_mode():
    from attnplug.backends.triton.runtime import interpreting

    if interpreting():
        pytest.skip("this process runs Triton in the interpreter (TRITON_INTERPRET=1); GPU tests need compiled kernels")


def test_conformance_suite_on_cuda_at_realistic_sizes(pytester):
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-rs", "--pyargs", "attnplug.plugins.conformance", "--attnplug-backend", "triton",
        "--attnplug-device", "cuda", "--attnplug-cases", str(HERE / "cases_triton.json"))
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-20000:]
    out = result.parseoutcomes()
    assert out.get("passed", 0) >= 100 and not out.get("failed")
    skipped = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert all("manager block size" in s or "declares" in s for s in skipped), skipped


def _paged(requests, num_heads, num_kv_heads, head_size, dtype, block_size=16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    lens = [c + s for c, s in requests]
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(nblk)
    perm = torch.randperm(num_blocks - 1, device=DEV, generator=g) + 1
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device=DEV)
    at = 0
    for i, n in enumerate(nblk):
        table[i, :n] = perm[at:at + n]
        at += n
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, device=DEV, generator=g).to(dtype)
    qlens = torch.tensor([s for _, s in requests])
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    q = torch.randn(int(qlens.sum()), num_heads, head_size, device=DEV, generator=g).to(dtype)
    return q, kv, qsl.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV), table


def _dense(q, kv, qsl, seq_lens, table, scale, window=None):
    """float32 reference, one request at a time (gathers its blocks)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=DEV)
    block_size = kv.shape[2]
    group = q.shape[1] // kv.shape[3]
    for i in range(len(seq_lens)):
        a, b, n = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        blocks = table[i, : -(-n // block_size)].long()
        k = kv[blocks, 0].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        v = kv[blocks, 1].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        s = torch.einsum("thd,nhd->htn", q[a:b].float(), k) * scale
        pos = torch.arange(n - (b - a), n, device=DEV)[:, None]
        key = torch.arange(n, device=DEV)[None]
        vis = key <= pos
        if window:
            vis &= key > pos - window
        out[a:b] = torch.einsum("htn,nhd->thd", s.masked_fill(~vis[None], float("-inf")).softmax(-1), v)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits, window", [(1, None), (16, None), (8, 1024), (1, 1024)])
def test_long_context_decode_and_prefill_against_dense(dtype, splits, window):
    from attnplug.backends.triton import paged_attention

    reqs = [(8191, 1), (5000, 1), (0, 777), (3000, 129), (12, 1)]
    q, kv, qsl, seq_lens, table = _paged(reqs, 32, 8, 128, dtype)
    out = torch.zeros_like(q)
    paged_attention(q, kv[:, 0], kv[:, 1], out, qsl, seq_lens, table, num_reqs=len(reqs), max_query_len=777,
                    scale=128 ** -0.5, sliding_window=window, num_kv_splits=splits)
    ref = _dense(q, kv, qsl, seq_lens, table, 128 ** -0.5, window)
    atol, rtol = (1e-2, 2e-2) if dtype == torch.bfloat16 else (2e-3, 1e-2)
    excess = ((out.float() - ref).abs() - (atol + rtol * ref.abs())).max().item()
    assert excess <= 0, f"worst error exceeds atol {atol} + rtol {rtol} * |ref| by {excess:.3g}"


@pytest.mark.parametrize("requests", [[(700, 1)] * 8 + [(0, 40), (100, 20)], [(3000, 1), (6000, 1)]],
                         ids=["unified_mixed", "split_kv_decode"])
def test_cuda_graph_replays_new_batches_from_persistent_buffers(requests, monkeypatch):
    # index values checked on the GPU in the eager calls (host reads), skipped during capture
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    from attnplug.backends.triton import TritonBackend
    from attnplug.cache_groups.specs import FullAttentionSpec
    from attnplug.core.contracts import BuilderConfig
    from attnplug.core.metadata import CommonAttentionMetadata

    heads, kv_heads, d, bs = 16, 4, 128, 16
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=d, dtype=torch.float16)
    num_tokens = sum(s for _, s in requests)
    cfg = BuilderConfig(max_num_reqs=len(requests), max_num_batched_tokens=num_tokens, max_model_len=8192)
    builder = TritonBackend.get_builder_cls()(spec, ["l0"], cfg, DEV)
    impl = TritonBackend.get_impl_cls()(heads, d, d ** -0.5, kv_heads)
    num_blocks = 1 + sum(-(-(c + s) // bs) for c, s in requests) * 2
    kv = torch.randn(TritonBackend.get_kv_cache_shape(num_blocks, bs, kv_heads, d), device=DEV).half()

    def batch(seed):
        rng = np.random.default_rng(seed)
        ids = rng.permutation(np.arange(1, num_blocks))
        at, table = 0, []
        for c, s in requests:
            n = -(-(c + s) // bs)
            table.append([int(x) for x in ids[at:at + n]] + [0] * (8192 // bs - n))
            at += n
        cm = CommonAttentionMetadata.from_lengths([c for c, _ in requests], [s for _, s in requests], table, bs,
                                                  device=DEV)
        g = torch.Generator(device=DEV).manual_seed(seed)
        return cm, [torch.randn(num_tokens, h, d, device=DEV, generator=g).half() for h in (heads, kv_heads, kv_heads)]

    cm, (q0, k0, v0) = batch(0)
    # graph builds copy into the builder's persistent buffers (an eager build passes the
    # step's own tensors through: a new batch would sit at new addresses the graph never reads)
    md = builder.build_for_cudagraph_capture(cm)
    q, k, v, out = q0.clone(), k0.clone(), v0.clone(), torch.zeros_like(q0)
    impl.forward(None, q, k, v, kv, md, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, q, k, v, kv, md, out)
    for seed in (1, 2):
        cm, (qn, kn, vn) = batch(seed)
        md_new = builder.build_for_cudagraph_capture(cm)
        for f in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
            assert getattr(md_new, f).data_ptr() == getattr(md, f).data_ptr(), f
        assert md_new.num_kv_splits == md.num_kv_splits
        q.copy_(qn), k.copy_(kn), v.copy_(vn)
        kv_eager = kv.clone()
        graph.replay()
        eager = torch.zeros_like(out)
        impl.forward(None, qn, kn, vn, kv_eager, md_new, eager)
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(kv, kv_eager)


def test_bad_slot_is_refused_on_the_gpu_with_validation(monkeypatch):
    from attnplug.backends.triton import write_kv_cache
    from attnplug.core.errors import MetadataError

    cache = torch.zeros(4, 16, 2, 64, device=DEV, dtype=torch.float16)
    key = torch.ones(2, 2, 64, device=DEV, dtype=torch.float16)
    slots = torch.tensor([3, 4 * 16], device=DEV)
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    with pytest.raises(MetadataError, match=r"slot_mapping\[1\] = 64 is outside the cache's 64 slots"):
        write_kv_cache(key, key, cache, cache.clone(), slots)
    assert not cache.any()


def test_slot_mapping_kernel_matches_the_numpy_path():
    from attnplug.backends.triton import compute_slot_mapping
    from attnplug.cache_groups.block_table import BlockTable

    rng = np.random.default_rng(0)
    num_reqs, bs = 200, 16
    table = BlockTable(bs, num_reqs, 512, 65536, device=DEV)
    computed, sched = rng.integers(0, 4000, num_reqs), rng.integers(1, 200, num_reqs)
    for r in range(num_reqs):
        table.add_row(rng.integers(1, 10**6, -(-int(computed[r] + sched[r]) // bs)).tolist(), r)
    table.commit(num_reqs)
    req = np.repeat(np.arange(num_reqs), sched)
    starts = np.concatenate([[0], np.cumsum(sched)[:-1]])
    pos = (computed[req] + np.arange(len(req)) - starts[req]).astype(np.int64)
    want = table.compute_slot_mapping(req, pos, num_tokens_padded=len(req) + 32).cpu()
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(sched)]), dtype=torch.int32, device=DEV)
    out = torch.empty(65536, dtype=torch.int64, device=DEV)
    got = compute_slot_mapping(qsl, torch.as_tensor(pos, device=DEV), table.get_device_tensor(num_reqs), bs, out,
                               num_reqs=num_reqs, num_tokens_padded=len(req) + 32)
    assert torch.equal(got.cpu(), want)
