"""Builds keep stable addresses for CUDA graphs, proved by replaying one (marker ``gpu``;
skipped without CUDA).

Real steps from the step compiler on the GPU (the steady-decode workload: seq_lens grow,
block tables gain blocks), two cache groups of one spec (the second shares the first's
build through ``update_block_table``), padded by the runner's ``PaddedMetadata`` and built
with ``build_for_cudagraph_capture``. A graph captures both groups' triton ``forward`` on
the first steady step; every later step is built again (into the builders' persistent
buffers), the graph is replayed, and its output and K/V caches must equal an eager
``forward`` of the same step built with ``build`` (zero-copy: the step's own buffers).
If a build moved a tensor the graph reads, the replay would read the first step's
metadata (or freed memory) and differ; the addresses are also compared directly. (A CPU
dry run of this test, the graph replaced by re-running a closure over the captured
metadata under the Triton interpreter, passes; with graph builds planted to hand out
freshly allocated tensors, and the direct address checks removed, the replay check fails:
"the replay wrote other slots".)

Run in a process without ``TRITON_INTERPRET`` (``tests/gpu/run_all.sh`` does).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]

DEV = "cuda"
N, STEPS, PAD = 8, 5, 4
HEADS, KV_HEADS, D, BS = 16, 4, 128, 16  # as test_triton_gpu's graph test: the same compiled variants
FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")


@pytest.fixture(autouse=True)
def compiled_mode():
    from attnplug.backends.triton.runtime import interpreting

    if interpreting():
        pytest.skip("this process runs Triton in the interpreter (TRITON_INTERPRET=1); GPU tests need compiled kernels")


def _addresses(per_group):
    return [tuple(getattr(md, f).data_ptr() for f in FIELDS) for md in per_group]


def test_graph_replays_read_each_steps_metadata_from_fixed_addresses():
    from attnplug.backends.triton import TritonBackend
    from attnplug.cache_groups.specs import FullAttentionSpec
    from attnplug.core.contracts import BuilderConfig
    from attnplug.runner.commands.bench.workloads import PROMPT_LENGTHS, steady_decode
    from attnplug.runner.execute.cudagraph import PaddedMetadata
    from attnplug.runner.execute.group_metadata import GroupMetadataBuilder
    from attnplug.runner.step.compiler import StepCompiler

    w = steady_decode(N, STEPS, block_size=BS, arrivals=False)  # rows never move; nobody finishes
    cfg = dict(w.config)
    cfg["max_num_reqs"] = N + PAD  # room for the padded rows of the graph step
    sc = StepCompiler(cfg.pop("block_sizes"), device=DEV, **cfg)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=D, dtype=torch.float16)
    bcfg = BuilderConfig(cfg["max_num_reqs"], cfg["max_num_batched_tokens"], cfg["max_model_len"])
    cls = TritonBackend.get_builder_cls()
    graph_builders = [cls(spec, [f"l{g}"], bcfg, DEV) for g in range(2)]
    eager_builders = [cls(spec, [f"l{g}"], bcfg, DEV) for g in range(2)]
    graph_group = GroupMetadataBuilder(graph_builders, [["l0"], ["l1"]])
    eager_group = GroupMetadataBuilder(eager_builders, [["l0"], ["l1"]])
    padded = PaddedMetadata(bcfg.max_num_reqs, DEV)
    impl = TritonBackend.get_impl_cls()(HEADS, D, D ** -0.5, KV_HEADS)
    # block ids come from count(1) per group and are never reused: bound them
    num_blocks = 2 + N * (-(-(max(PROMPT_LENGTHS) + STEPS + 1) // BS) + 1)
    shape = TritonBackend.get_kv_cache_shape(num_blocks, BS, KV_HEADS, D)
    gen = torch.Generator(device=DEV).manual_seed(0)
    kv = [torch.randn(shape, device=DEV, generator=gen).half() for _ in range(2)]
    static = graph = captured = None
    replays = 0
    for i, so in enumerate(w.steps):
        sc.update_states(so)
        inputs = sc.prepare_inputs(so)
        keep = np.flatnonzero(~inputs.discard)
        if i >= w.num_warmup:
            assert inputs.num_reqs == N and inputs.common_attn_metadata[0].max_query_len == 1
            per_group, _ = graph_group.build(padded.pad(inputs.common_attn_metadata, N + PAD), for_cudagraph=True)
            assert graph_group.counters.reuses == 1, "group 1 shares group 0's build"
            assert all(md.graph and md.num_reqs == N + PAD for md in per_group)
            T = per_group[0].slot_mapping.shape[0]
            fresh = [torch.randn(T, h, D, device=DEV, generator=gen).half() for h in (HEADS, KV_HEADS, KV_HEADS)]
            if graph is None:  # capture on the first steady step (compile outside the capture)
                static = [t.clone() for t in fresh] + [torch.zeros(T, HEADS, D, device=DEV, dtype=torch.float16)]
                q, k, v, out = static
                for g in range(2):
                    impl.forward(None, q, k, v, kv[g].clone(), per_group[g], out.clone())
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for g in range(2):  # both layers write into the same output (the second wins)
                        impl.forward(None, q, k, v, kv[g], per_group[g], out)
                captured = _addresses(per_group)
            else:
                assert _addresses(per_group) == captured, "a graph build moved a tensor the graph reads"
                for g in range(2):
                    assert per_group[g].block_table_tensor.data_ptr() == graph_builders[g]._block_table.data_ptr()
                q, k, v, out = static
                q.copy_(fresh[0]), k.copy_(fresh[1]), v.copy_(fresh[2])
                kv_eager = [c.clone() for c in kv]
                graph.replay()
                eager_md, _ = eager_group.build(inputs.common_attn_metadata)
                cm = inputs.common_attn_metadata[0]
                assert _addresses(eager_md) == [tuple(t.data_ptr() for t in (c.query_start_loc, c.seq_lens,
                                                                             c.block_table_tensor, c.slot_mapping))
                                                for c in inputs.common_attn_metadata], "eager builds pass through"
                eager_out = torch.zeros_like(out)
                for g in range(2):
                    impl.forward(None, fresh[0], fresh[1], fresh[2], kv_eager[g], eager_md[g], eager_out)
                torch.cuda.synchronize()
                for g in range(2):
                    assert torch.equal(kv[g], kv_eager[g]), f"group {g}: the replay wrote other slots"
                n = cm.num_actual_tokens
                # graph builds may pick another split-KV count than eager ones: rounding differs
                torch.testing.assert_close(out[:n].float(), eager_out[:n].float(), atol=1e-2, rtol=1e-2)
                replays += 1
        sc.append_output_tokens(keep, np.ones(keep.shape[0], dtype=np.int64))
    assert replays == STEPS - 1
