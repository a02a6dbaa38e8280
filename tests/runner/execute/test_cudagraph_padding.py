"""CUDA-graph padding on the CPU: graph-mode negotiation (and its reason), the padding
arithmetic, padded metadata, and real padded steps (StepCompiler -> padded metadata ->
builder -> impl) through torch_native and the emulated flash backends on a poisoned
cache: a padded step changes no KV byte but the real tokens' slots, and its real output
rows equal the unpadded step's. Also the ModelRunner option end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.emulators import FlashAttn2EmulatedBackend, FlashAttn3EmulatedBackend, FlashInferEmulatedBackend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.specs import FullAttentionSpec
from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.contracts import AttentionCGSupport, BuilderConfig
from attnplug.core.errors import ConfigError, MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.execute import cudagraph as cg
from attnplug.runner.execute.cudagraph import CUDAGraphDispatcher, CUDAGraphMode, PaddedMetadata, negotiate_cudagraph_mode

FULL, DECODE, PIECEWISE, NONE = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.PIECEWISE,
                                 CUDAGraphMode.NONE)


def _builders(*backends, block_size=16):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16)
    return [b.get_builder_cls()(spec, [f"l{i}"], BuilderConfig(8, 64, 256), "cpu") for i, b in enumerate(backends)]


def test_module_doctests():
    import doctest

    assert doctest.testmod(cg).failed == 0


def test_negotiation_takes_the_least_capable_builder_and_says_why():
    fa3, fi, fa2 = FlashAttn3EmulatedBackend, FlashInferEmulatedBackend, FlashAttn2EmulatedBackend
    tn = TorchNativeBackend
    assert negotiate_cudagraph_mode(_builders(fa3), "full", "cpu").mode is FULL
    d = negotiate_cudagraph_mode(_builders(fa3, fi), "full", "cuda", names=["flash_attn", "flashinfer"])
    assert d.mode is DECODE and d.capture
    assert "cache group 1 (flashinfer, FlashInferEmulatedBuilder): UNIFORM_SINGLE_TOKEN_DECODE" in d.reason
    fa2_builder = _builders(fa2, block_size=256)
    assert negotiate_cudagraph_mode(fa2_builder, "full", "cuda").mode is DECODE  # UNIFORM_BATCH
    d = negotiate_cudagraph_mode(_builders(fa3) + _builders(tn), "full", "cuda", names=["fa", "torch_native"])
    assert d.mode is PIECEWISE and not d.capture and "torch_native" in d.reason and "eagerly" in d.reason
    assert d.limiting.startswith("cache group 1 (torch_native")
    d = negotiate_cudagraph_mode(_builders(fa3), "full_decode_only", "cuda")
    assert d.mode is DECODE and d.limiting is None and "as requested" in d.reason
    assert negotiate_cudagraph_mode(_builders(fa3), "full", "cpu").capture is False
    assert negotiate_cudagraph_mode(_builders(fa3), None, "cuda").mode is NONE
    with pytest.raises(ConfigError, match="not a CUDA-graph mode"):
        negotiate_cudagraph_mode([], "sometimes", "cuda")


def test_dispatcher_pads_tokens_and_requests_to_the_next_capture_size():
    d = CUDAGraphDispatcher(FULL, [1, 2, 4, 8, 16, 32], max_num_reqs=16, max_num_batched_tokens=40)
    b = d.dispatch(num_tokens=9, num_reqs=5, max_query_len=5)
    assert (b.num_tokens_padded, b.num_reqs_padded, b.uniform_decode, b.use_graph) == (16, 8, False, True)
    assert (b.num_tokens, b.num_reqs) == (9, 5)  # the real counts stay
    b = d.dispatch(num_tokens=3, num_reqs=3, max_query_len=1)
    assert b.key == (4, 4, True)  # uniform decode: one padded request per padded token
    assert d.dispatch(8, 8, 1).padded is False  # already a capture size
    assert d.dispatch(33, 2, 20).use_graph is False  # beyond the largest size: eager, unpadded
    small = CUDAGraphDispatcher(FULL, [1, 2, 4, 8, 16, 32], max_num_reqs=12, max_num_batched_tokens=40)
    assert small.dispatch(10, 10, 1).use_graph is False  # 16 padded requests > max_num_reqs
    assert d.dispatch(0, 0, 0).use_graph is False
    decode_only = CUDAGraphDispatcher(DECODE, [1, 2, 4, 8], 8, 8)
    assert decode_only.dispatch(5, 2, 4).use_graph is False and decode_only.dispatch(5, 5, 1).key == (8, 8, True)
    for mode in (PIECEWISE, NONE):
        b = CUDAGraphDispatcher(mode, [4, 8], 8, 8).dispatch(3, 2, 2)
        assert not b.use_graph and not b.padded
    assert CUDAGraphDispatcher(FULL, [64, 1, 2, 2], 8, 8).capture_sizes == (1, 2)
    with pytest.raises(ConfigError, match="no size"):
        CUDAGraphDispatcher(FULL, [64], 8, 8)


@pytest.mark.parametrize("args, message", [
    ((-3, 0, 0), "non-negative ints"), ((2.0, 1, 1), "non-negative ints"),
    ((2, 5, 1), "every request has 1..num_tokens"), ((4, 2, 5), "every request has 1..num_tokens"),
    ((4, 2, 0), "every request has 1..num_tokens"),
    ((41, 2, 20), "max_num_batched_tokens=40"), ((17, 17, 1), "max_num_reqs=16"),
])
def test_dispatch_refuses_counts_no_step_can_have(args, message):
    d = CUDAGraphDispatcher(FULL, [1, 2, 4, 8, 16, 32], max_num_reqs=16, max_num_batched_tokens=40)
    with pytest.raises(MetadataError, match=message):
        d.dispatch(*args)


@pytest.mark.parametrize("mode, sizes, limits, message", [
    ("fulll", [1, 2], (8, 8), "not a CUDA-graph mode"),
    ("full", [0, 2], (8, 8), "positive ints"), ("full", [2.7], (8, 8), "positive ints"),
    ("full", "12", (8, 8), "positive ints"), ("full", [True], (8, 8), "positive ints"),
    ("full", [1, 2], (0, 8), "max_num_reqs"), ("full", [1, 2], (8, 8.5), "max_num_batched_tokens"),
])
def test_dispatcher_refuses_bad_configuration(mode, sizes, limits, message):
    with pytest.raises(ConfigError, match=message):
        CUDAGraphDispatcher(mode, sizes, *limits)


def test_dispatcher_takes_mode_names_and_numpy_sizes():
    d = CUDAGraphDispatcher("FULL_DECODE_ONLY", np.array([1, 2, 4]), 4, 4)
    assert d.mode is DECODE and d.capture_sizes == (1, 2, 4) and d.dispatch(3, 3, 1).key == (4, 4, True)
    assert CUDAGraphDispatcher("none", [], 4, 4).dispatch(3, 3, 1).use_graph is False


def test_negotiation_wants_one_name_per_builder():
    with pytest.raises(ValueError, match="one per builder"):
        negotiate_cudagraph_mode([object(), object()], "full", "cpu", names=["a"])


def test_padded_metadata_repeats_query_start_loc_and_zeroes_padded_requests():
    table = [[1, 2, 0], [3, 4, 0], [5, 6, 7], [8, 0, 0], [9, 10, 0]]
    cm = CommonAttentionMetadata.from_lengths([6, 4, 8, 2, 0], [1, 1, 1, 1, 5], table, block_size=4)
    pm = PaddedMetadata(8, "cpu")
    (p,) = pm.pad([cm], 8)
    assert p.query_start_loc.tolist() == [0, 1, 2, 3, 4, 9, 9, 9, 9] == p.query_start_loc_cpu.tolist()
    assert p.seq_lens.tolist() == [7, 5, 9, 3, 5, 0, 0, 0] == p.seq_lens_cpu.tolist()
    assert p.block_table_tensor.tolist() == table + [[NULL_BLOCK_ID] * 3] * 3
    assert p.num_computed_tokens_cpu.tolist()[5:] == [0, 0, 0] and not p.is_prefilling[5:].any()
    assert (p.num_reqs, p.num_actual_tokens) == (5, 9)
    (again,) = pm.pad([cm], 8)  # persistent buffers: same addresses every step
    assert again.query_start_loc.data_ptr() == p.query_start_loc.data_ptr()
    assert again.block_table_tensor.data_ptr() == p.block_table_tensor.data_ptr()
    with pytest.raises(MetadataError, match="num_reqs_padded"):
        pm.pad([cm], 9)


# --- real padded steps on a poisoned cache -------------------------------------------------
POISON, PAD_INPUT = 1000.0, -777.0
BLOCK = 4


def _step(backend, requests, padded: bool, seed=0):
    """One step through StepCompiler -> (padded) metadata -> builder -> impl on a poisoned cache.

    ``requests``: ``(num_computed_tokens, num_scheduled_tokens)`` per request; their context
    is pre-filled with random K/V. Returns (output rows of real tokens in request order,
    cache before, cache after, real slots).
    """
    from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
    from attnplug.runner.step.compiler import StepCompiler

    H, H_kv, D = 4, 2, 16
    g = torch.Generator().manual_seed(seed)
    builder_cls = backend.get_builder_cls()
    sc = StepCompiler([BLOCK], max_num_reqs=8, max_model_len=64, max_num_batched_tokens=32,
                      reorder_batch_threshold=builder_cls.reorder_batch_threshold, num_blocks=40, validate=True)
    new, at = [], 1
    for i, (c, s) in enumerate(requests):
        n = -(-(c + s) // BLOCK)
        new.append(NewRequestData(req_id=f"r{i}", prompt_token_ids=[1] * (c + s), block_ids=([*range(at, at + n)],),
                                  num_computed_tokens=c))
        at += n
    so = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(),
                         num_scheduled_tokens={f"r{i}": s for i, (_, s) in enumerate(requests)})
    sc.update_states(so)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H_kv, head_size=D)
    builder = builder_cls(spec, ["l0"], BuilderConfig(8, 32, 64), "cpu")
    impl = backend.get_impl_cls()(H, D, D ** -0.5, H_kv)
    batch = CUDAGraphDispatcher(FULL if padded else NONE, [1, 2, 4, 8, 16, 32], 8, 32).dispatch(
        *cg.batch_shape(sc.input_batch.num_scheduled_tokens[:sc.input_batch.num_reqs]))
    inputs = sc.prepare_inputs(so, batch.num_tokens_padded if batch.padded else None)
    cm = inputs.common_attn_metadata[0]
    if batch.use_graph:
        cm = PaddedMetadata(8, "cpu").pad([cm], batch.num_reqs_padded)[0]
    # a graph build where the backend captures this batch; else the padded step runs eagerly
    # (flashinfer captures pure decodes only: its padded mixed step is built like a PIECEWISE one)
    captured = builder_cls.get_cudagraph_support(spec) == AttentionCGSupport.ALWAYS or all(s == 1 for _, s in requests)
    md = builder.build_for_cudagraph_capture(cm) if batch.use_graph and captured else builder.build(0, cm)
    cache = torch.full(backend.get_kv_cache_shape(40, BLOCK, H_kv, D), POISON)
    kc, vc = backend.split_kv_cache(cache)
    Q, P = inputs.num_actual_tokens, inputs.num_padded_tokens
    rows = inputs.req_indices[:Q]
    req_of_row = np.asarray([int(r[1:]) for r in inputs.req_ids])
    token_req, token_pos = req_of_row[rows], inputs.positions_cpu[:Q].numpy()
    for i, (c, s) in enumerate(requests):  # the context, as if computed by earlier steps
        blocks = torch.as_tensor(new[i].block_ids[0])
        pos = torch.arange(c)
        kc[blocks[pos // BLOCK], pos % BLOCK] = torch.randn(c, H_kv, D, generator=g)
        vc[blocks[pos // BLOCK], pos % BLOCK] = torch.randn(c, H_kv, D, generator=g)
    # inputs depend only on (request, position), so padded and unpadded steps see the same tokens
    token_g = [torch.Generator().manual_seed(1000 * int(r) + int(p)) for r, p in zip(token_req, token_pos)]
    q = torch.stack([torch.randn(H, D, generator=tg) for tg in token_g])
    k = torch.stack([torch.randn(H_kv, D, generator=tg) for tg in token_g])
    v = torch.stack([torch.randn(H_kv, D, generator=tg) for tg in token_g])
    pad = lambda t: torch.cat([t, torch.full((P - Q, *t.shape[1:]), PAD_INPUT)])  # noqa: E731
    before = cache.clone()
    out = torch.zeros(P, H, D)
    impl.forward(None, pad(q), pad(k), pad(v), cache, md, out)
    order = np.lexsort((token_pos, token_req))
    slots = cm.slot_mapping[:Q]
    assert (cm.slot_mapping[Q:] == PAD_SLOT_ID).all() and md is not None
    return out[:Q][order], before, cache, slots, batch


@pytest.mark.parametrize("backend", [TorchNativeBackend, FlashAttn3EmulatedBackend, FlashInferEmulatedBackend],
                         ids=lambda b: b.get_name())
@pytest.mark.parametrize("requests", [[(5, 1), (0, 3), (9, 2)], [(5, 1), (12, 1), (3, 1)]],
                         ids=["mixed", "uniform_decode"])
def test_padded_step_changes_no_kv_byte_but_the_real_slots(backend, requests):
    out, before, after, slots, batch = _step(backend, requests, padded=True)
    assert batch.padded and batch.use_graph
    expected = before.clone()
    kc, vc = backend.split_kv_cache(expected)
    ka, va = backend.split_kv_cache(after)
    kc[slots // BLOCK, slots % BLOCK] = ka[slots // BLOCK, slots % BLOCK]
    vc[slots // BLOCK, slots % BLOCK] = va[slots // BLOCK, slots % BLOCK]
    assert torch.equal(after, expected)  # nothing else changed: no padded write, null block untouched
    assert not (ka[slots // BLOCK, slots % BLOCK] == PAD_INPUT).any()
    ref_out, _, ref_after, ref_slots, ref_batch = _step(backend, requests, padded=False)
    assert not ref_batch.padded and torch.equal(ref_slots, slots)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(after, ref_after)


# --- the ModelRunner option ------------------------------------------------------------------
def _generate(backend, mode, prompts, max_tokens=3):
    from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
    from attnplug.runner.serve.engine import LLMEngine
    from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
    from attnplug.runner.models.presets import make_preset_model
    from attnplug.runner.execute.sampler import SamplingParams
    from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig

    model = make_preset_model(backend_for_layer=lambda name, cfg: backend, block_size=16)
    groups = group_layers_by_spec(model.kv_cache_specs(16))
    kv = KVCacheConfig(32, groups)
    runner = ModelRunner(model, kv, [backend] * len(groups), RunnerConfig(4, 128, 32), record_logits=True,
                         cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32])
    engine = LLMEngine(Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128), kv),
                       runner)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    res = engine.run()
    return runner, {k: (r.output_token_ids, torch.stack(r.logits)) for k, r in res.items()}


def test_model_runner_pads_steps_and_matches_the_unpadded_run():
    prompts = [[5, 9, 33, 7, 1], [100, 2, 3], [7] * 11]
    runner, got = _generate(FlashAttn3EmulatedBackend, "full", prompts)
    assert runner.cudagraphs.mode is FULL and runner.cudagraphs.counts["graph"] >= 3
    assert "on cpu nothing is captured" in runner.cudagraphs.decision.reason
    plain, want = _generate(FlashAttn3EmulatedBackend, None, prompts)
    assert plain.cudagraphs is None
    for rid, (tokens, logits) in want.items():
        assert got[rid][0] == tokens
        torch.testing.assert_close(got[rid][1], logits, atol=1e-4, rtol=1e-4)
    runner, _ = _generate(TorchNativeBackend, "full", prompts[:1], max_tokens=1)
    assert runner.cudagraphs.mode is PIECEWISE and runner.cudagraphs.counts["graph"] == 0
    assert "torch_native" in runner.cudagraphs.decision.reason
