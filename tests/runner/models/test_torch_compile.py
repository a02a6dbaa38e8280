"""``torch.compile(fullgraph=True)`` over attnplug models (runner/models/attention_op.py).

Each attention layer becomes one ``attnplug::attention`` node and each Mamba2 mixer one
``attnplug::mamba_mixer`` node; at run time the op calls the layer's impl with the step's
metadata from the forward context. The tiny models run a real engine loop (scheduler,
step compiler, builders, sampler) of at least 10 steps with changing token counts,
compiled and eager: same tokens, same logits, at most two compilations (both with
``F.linear``: the fixture turns the prepacked CPU linears off).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from attnplug.backends.emulators import FlashAttn3EmulatedBackend, FlashInferEmulatedBackend
from attnplug.backends.mamba2 import Mamba2Backend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.core import BuilderConfig, CommonAttentionMetadata
from attnplug.core.errors import MetadataError
from attnplug.core.mamba import MambaLayerConfig, MambaStateCache
from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
from attnplug.runner.execute.sampler import SamplingParams
from attnplug.runner.models import build_model, make_preset_model
from attnplug.runner.models.attention_op import (CompiledModel, attention_op, backend_layers, forward_context,
                                                 mamba_mixer_op)
from attnplug.runner.models.mamba2 import Mamba2Mixer
from attnplug.runner.serve.engine import LLMEngine
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig

BLOCK = 16


@pytest.fixture(autouse=True)
def _one_gemm_kernel(monkeypatch):
    """Eager and compiled run the same GEMM (``F.linear``): a traced graph uses it, eager CPU
    linears would otherwise use oneDNN's prepacked kernel (``runner/models/cpu_linear.py``),
    whose float32 sums differ in the last bits."""
    from attnplug.runner.models import cpu_linear
    monkeypatch.setattr(cpu_linear, "ENABLED", False)


GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "sliding_window": 7, "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                               "sliding_attention"], "query_pre_attn_scalar": 24,
          "max_position_embeddings": 256, "initializer_range": 0.1}
PROMPTS = ([5, 9, 33, 7, 1], [100, 2, 3], [7] * 11, list(range(1, 21)))
MAX_TOKENS = (6, 12, 4, 8)
ATTN, MAMBA = torch.ops.attnplug.attention.default, torch.ops.attnplug.mamba_mixer.default


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's caches are per code object: every model of a test compiles the same
    ``forward``, and the entries of earlier tests would count towards its recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphRecorder:
    """A ``torch.compile`` backend: keeps every graph Dynamo hands over (one per
    compilation) and runs it with the ``inner`` backend."""

    def __init__(self, inner: str = "aot_eager"):
        self.graphs: list[torch.fx.GraphModule] = []
        self.inner = lookup_backend(inner)

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.inner(gm, example_inputs)

    def count(self, target) -> list[int]:
        """Per graph, how many nodes call ``target``."""
        return [sum(n.target is target for n in gm.graph.nodes) for gm in self.graphs]


class TokenCounts:
    """Calls ``fn`` like the model, recording each step's token count (``input_ids.shape[0]``)."""

    def __init__(self, fn):
        self.fn, self.sizes = fn, []

    def __call__(self, input_ids, *args):
        self.sizes.append(int(input_ids.shape[0]))
        return self.fn(input_ids, *args)

    def __getattr__(self, name):
        return getattr(self.__dict__["fn"], name)


def _model(name, attention_backend, device="cpu", dtype=torch.float32, block=BLOCK):
    def pick(layer_name, cfg):
        return Mamba2Backend if isinstance(cfg, MambaLayerConfig) else attention_backend
    kw = dict(backend_for_layer=pick, block_size=block, device=device, dtype=dtype)
    if name == "gemma3":
        return build_model(GEMMA3, seed=3, **kw)
    return make_preset_model(name, **kw)


def _generate(model, compile_backend=None, attention_backend=TorchNativeBackend, device="cpu", block=BLOCK):
    """Run PROMPTS to completion through the engine, eager or compiled with ``compile_backend``.

    Returns ``({rid: (tokens, logits [n, vocab] float32)}, each step's token count)``."""
    groups = group_layers_by_spec(model.kv_cache_specs(block))
    kv = KVCacheConfig(48, groups)
    backends = [Mamba2Backend if g.kv_cache_spec.kind.value == "mamba" else attention_backend for g in groups]
    called = TokenCounts(model if compile_backend is None else CompiledModel(model, backend=compile_backend))
    runner = ModelRunner(called, kv, backends, RunnerConfig(4, 128, 16), device, record_logits=True)
    engine = LLMEngine(Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128), kv),
                       runner)
    for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=m))
    res = engine.run()
    return {k: (r.output_token_ids, torch.stack(r.logits)) for k, r in res.items()}, called.sizes


def _assert_same(got, want, atol=1e-5):
    assert got.keys() == want.keys() and len(want) == len(PROMPTS)
    for rid, (tokens, logits) in want.items():
        assert got[rid][0] == tokens, rid
        torch.testing.assert_close(got[rid][1], logits, atol=atol, rtol=atol)


@pytest.mark.parametrize("name", ["tiny-llama", "gemma3", "tiny-hybrid"])
def test_compiled_model_equals_eager_with_at_most_two_compilations(name):
    model = _model(name, TorchNativeBackend)
    want, eager_sizes = _generate(model)
    rec = GraphRecorder("aot_eager")
    got, sizes = _generate(model, rec)
    assert sizes == eager_sizes and len(sizes) >= 10 and len(set(sizes)) >= 4, sizes
    _assert_same(got, want)
    assert 1 <= len(rec.graphs) <= 2, f"{len(rec.graphs)} compilations over token counts {sizes}"
    layers = backend_layers(model)
    num_mamba = sum(isinstance(m, Mamba2Mixer) for m in layers.values())
    assert rec.count(ATTN) == [len(layers) - num_mamba] * len(rec.graphs)
    assert rec.count(MAMBA) == [num_mamba] * len(rec.graphs)
    assert num_mamba == (2 if name == "tiny-hybrid" else 0)


@pytest.mark.parametrize("backend", [FlashAttn3EmulatedBackend, FlashInferEmulatedBackend],
                         ids=lambda b: b.__name__)
def test_flash_impls_compile_through_the_op(backend):
    """The real flash_attn / flashinfer builders and impls (their kernels emulated on the CPU)."""
    model = _model("tiny-llama", backend)
    want, _ = _generate(model, attention_backend=backend)
    rec = GraphRecorder("eager")
    got, _ = _generate(model, rec, attention_backend=backend)
    _assert_same(got, want)
    assert 1 <= len(rec.graphs) <= 2 and rec.count(ATTN) == [4] * len(rec.graphs)


def test_triton_compiles_through_the_op():
    """The triton impl, in the Triton interpreter: in a fresh process with TRITON_INTERPRET=1
    unless this one already interprets (Triton fixes its mode at import)."""
    from attnplug.backends.triton import TritonBackend
    from attnplug.backends.triton.runtime import interpreting, triton_import_error

    if triton_import_error() is not None:
        pytest.skip(triton_import_error())
    if interpreting():  # against eager torch_native (an eager interpreter run would double the time)
        want, _ = _generate(_model("tiny-llama", TorchNativeBackend))
        rec = GraphRecorder("eager")
        got, _ = _generate(_model("tiny-llama", TritonBackend), rec, attention_backend=TritonBackend)
        _assert_same(got, want, atol=1e-4)
        assert 1 <= len(rec.graphs) <= 2 and rec.count(ATTN) == [4] * len(rec.graphs)
        return
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: test_gpu_backends_compile_through_the_op covers the compiled kernels")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", f"{__file__}::test_triton_compiles_through_the_op"],
                         cwd=Path(__file__).resolve().parents[3], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
@pytest.mark.parametrize("name, dtype, block", [("triton", torch.float32, 16), ("flash_attn", torch.bfloat16, 256),
                                                ("flashinfer", torch.bfloat16, 16)])
def test_gpu_backends_compile_through_the_op(name, dtype, block):
    """The built-in GPU backends' real kernels inside the op (aot_eager: the rest of the
    model computes as eager does, so tokens compare exactly). The triton case passed on an
    H200 (session 18); flash_attn and flashinfer are skipped where not installed."""
    from attnplug.plugins import get_backend

    backend = get_backend(name)
    ok, why = backend.is_available()
    if not ok:
        pytest.skip(f"requires {name}: {why}")
    model = _model("tiny-llama", backend, device="cuda", dtype=dtype, block=block)
    reasons = backend.validate_configuration(next(iter(model.layer_configs(block).values())))
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    want, _ = _generate(model, attention_backend=backend, device="cuda", block=block)
    rec = GraphRecorder("aot_eager")
    got, _ = _generate(model, rec, attention_backend=backend, device="cuda", block=block)
    _assert_same(got, want, atol=1e-2)
    assert 1 <= len(rec.graphs) <= 2 and rec.count(ATTN) == [4] * len(rec.graphs)


EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "plugin-example"


@pytest.fixture
def example_plugin(monkeypatch):
    """The example third-party backend of docs/examples, imported from its source tree."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    before = set(sys.modules)
    from attnplug_sdpa_example.backend import SdpaExampleBackend
    yield SdpaExampleBackend
    for mod in set(sys.modules) - before:
        if mod.startswith("attnplug_sdpa_example"):
            del sys.modules[mod]


def test_a_plugin_backend_compiles_without_knowing(example_plugin):
    """The example plugin's impl loops over Python ints of its metadata; traced, it could not
    be one graph for every step. Through the op it is, and it runs at every step."""
    impl_cls = example_plugin.get_impl_cls()
    calls = []

    class CountingImpl(impl_cls):
        def forward(self, layer, *args):
            calls.append(layer.layer_name)
            return super().forward(layer, *args)

    class CountingBackend(example_plugin):
        @classmethod
        def get_impl_cls(cls):
            return CountingImpl

    model = _model("tiny-llama", CountingBackend)
    want, sizes = _generate(model, attention_backend=CountingBackend)
    assert len(calls) == 4 * len(sizes)
    rec = GraphRecorder("eager")
    got, _ = _generate(model, rec, attention_backend=CountingBackend)
    _assert_same(got, want)
    assert len(calls) == 2 * 4 * len(sizes), "the compiled run calls the impl at every step"
    assert 1 <= len(rec.graphs) <= 2


def test_the_op_needs_the_forward_context():
    """The compiled forward never reads ``attn_metadata`` (``{}`` here): the op reads the
    context at run time, and says what is missing."""
    model = _model("tiny-llama", TorchNativeBackend)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    kv = {n: torch.zeros(TorchNativeBackend.get_kv_cache_shape(4, BLOCK, 2, 32)) for n in model.layer_names}
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(MetadataError, match="outside a forward context"):
        compiled(ids, torch.arange(3), {}, kv)
    layers = backend_layers(model)
    first = model.layer_names[0]
    with forward_context(layers, {}), pytest.raises(MetadataError, match=f"attn_metadata has no entry.*{first}"):
        compiled(ids, torch.arange(3), {}, kv)
    with forward_context({}, {}), pytest.raises(MetadataError, match="forward context's layers has no entry"):
        compiled(ids, torch.arange(3), {}, kv)
    wrapped = CompiledModel(model, backend="eager")
    with pytest.raises(MetadataError, match=f"kv_caches has no entry.*{model.layer_names[-1]}"):
        wrapped(ids, torch.arange(3), {}, {n: kv[n] for n in model.layer_names[:-1]})
    with pytest.raises(MetadataError, match=f"attn_metadata has no entry.*{first}"):
        wrapped(ids, torch.arange(3), {}, kv)


def _one_step(backend, spec_kind="attention"):
    """A tiny model's first attention (or Mamba) layer, its name, its backend metadata for one
    two-request step (a 5-token prefill and a decode after 4 tokens) and its cache spec."""
    model = _model("tiny-hybrid" if spec_kind == "mamba" else "tiny-llama", TorchNativeBackend)
    name = next(n for n, s in model.kv_cache_specs(BLOCK).items() if (s.kind.value == "mamba") == (spec_kind == "mamba"))
    layer = backend_layers(model)[name]
    spec = model.kv_cache_specs(BLOCK)[name]
    builder = backend.get_builder_cls()(spec, [name], BuilderConfig(4, 64, 64), "cpu")
    cm = CommonAttentionMetadata.from_lengths([0, 4], [5, 1], [[1, 0], [2, 0]], block_size=BLOCK)
    return layer, name, builder.build(0, cm), spec


def test_opcheck_attention():
    """torch.library.opcheck: the schema's mutations (kv_cache, output) are the op's, the
    fake impl agrees with the real one, and the op survives AOT dispatch with dynamic shapes."""
    layer, name, meta, spec = _one_step(TorchNativeBackend)
    g = torch.Generator().manual_seed(0)
    n = 6
    q = torch.randn(n, layer.num_heads, layer.head_size, generator=g)
    k, v = (torch.randn(n, layer.num_kv_heads, layer.head_size, generator=g) for _ in range(2))
    kv = torch.randn(TorchNativeBackend.get_kv_cache_shape(3, BLOCK, layer.num_kv_heads, layer.head_size), generator=g)
    want_kv = kv.clone()
    want = layer.impl.forward(layer, q, k, v, want_kv, meta, torch.zeros_like(q))
    out = torch.zeros_like(q)
    with forward_context({name: layer}, {name: meta}):
        torch.library.opcheck(attention_op, (q, k, v, kv.clone(), torch.zeros_like(q), name))
        attention_op(q, k, v, kv, out, name)
    assert torch.equal(out, want) and torch.equal(kv, want_kv) and out.abs().sum() > 0


def test_opcheck_mamba_mixer():
    layer, name, meta, spec = _one_step(Mamba2Backend, "mamba")
    g = torch.Generator().manual_seed(0)
    c = layer.layer_cfg
    xbc, dt = torch.randn(6, c.conv_dim, generator=g), torch.randn(6, c.num_heads, generator=g)
    state = Mamba2Backend.allocate_state_cache(spec, 4, "cpu")
    state.conv_state.normal_(generator=g), state.ssm_state.normal_(generator=g)
    out = torch.zeros(6, c.intermediate_size)
    with forward_context({name: layer}, {name: meta}), torch.no_grad():
        torch.library.opcheck(mamba_mixer_op, (xbc, dt, state.conv_state.clone(), state.ssm_state.clone(),
                                               torch.zeros_like(out), name))
        want = MambaStateCache(state.conv_state.clone(), state.ssm_state.clone())
        want_out = layer.impl.forward(layer, xbc, dt, want, meta, torch.zeros_like(out))
        mamba_mixer_op(xbc, dt, state.conv_state, state.ssm_state, out, name)
    assert torch.equal(out, want_out) and out.abs().sum() > 0
    assert torch.equal(state.conv_state, want.conv_state) and torch.equal(state.ssm_state, want.ssm_state)


@pytest.mark.slow
def test_inductor_writes_the_cache_in_place(monkeypatch):
    """Under inductor the op gets the runner's own KV cache (re-inplaced, no clone)."""
    if os.environ.get("ATTNPLUG_SLOW") != "1":
        pytest.skip("inductor on the CPU compiles C++: set ATTNPLUG_SLOW=1")
    from attnplug.backends.torch_native.impl import TorchNativeAttentionImpl

    seen = []
    real = TorchNativeAttentionImpl.forward

    def spy(self, layer, q, k, v, kv_cache, meta, out):
        seen.append(kv_cache.data_ptr())
        return real(self, layer, q, k, v, kv_cache, meta, out)

    cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    model = build_model(cfg, block_size=BLOCK, seed=0)
    want = model(torch.tensor([3, 4]), torch.arange(2), *_single_request_inputs(model))
    kv_meta = _single_request_inputs(model)
    monkeypatch.setattr(TorchNativeAttentionImpl, "forward", spy)
    got = CompiledModel(model, backend="inductor")(torch.tensor([3, 4]), torch.arange(2), *kv_meta)
    torch.testing.assert_close(got, want)
    assert seen == [next(iter(kv_meta[1].values())).data_ptr()]


def _single_request_inputs(model):
    (name, spec), = model.kv_cache_specs(BLOCK).items()
    meta = TorchNativeBackend.get_builder_cls()(spec, [name], BuilderConfig(1, 8, 8), "cpu").build(
        0, CommonAttentionMetadata.from_lengths([0], [2], [[1]], block_size=BLOCK))
    kv = torch.zeros(TorchNativeBackend.get_kv_cache_shape(2, BLOCK, spec.num_kv_heads, spec.head_size))
    return {name: meta}, {name: kv}
