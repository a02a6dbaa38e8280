"""An fp8 checkpoint's ``self_attn.k_scale`` / ``v_scale`` (/ ``q_scale``, ``kv_scale``) are
loaded with the weights and used by ``--kv-scales checkpoint`` (and ``auto``, the default,
when every attention layer has them); the run's table says where the scales came from;
malformed scale tensors are refused by the strict loader, naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnplug.runner.models import WeightLoadError
from attnplug.runner.models.kv_scales import attach_kv_scales, attention_layers, resolve_kv_scale_source


def _model(backend: str = "torch_native"):
    from attnplug.runner.commands.model_loading import load_model_for_run
    from attnplug.runner.commands.assemble import resolve_backend

    return load_model_for_run("tiny-llama", backend=backend, block_size=16, seed=0, resolve=resolve_backend,
                              kv_cache_dtype=torch.float8_e4m3fn)


def _with_scales(model, per_head: bool, extra=None):
    sd = {k: v.detach().clone() for k, v in model.named_parameters()}
    for i, (_, layer) in enumerate(sorted(attention_layers(model).items())):
        path = next(p for p, m in model.named_modules() if m is layer)
        h = layer.num_kv_heads
        sd[f"{path}.k_scale"] = (torch.arange(1, h + 1) * 0.01 * (i + 1)) if per_head else torch.tensor(0.02 * (i + 1))
        sd[f"{path}.v_scale"] = torch.tensor([0.03 * (i + 1)])  # [1]: per tensor
        sd[f"{path}.q_scale"] = torch.tensor(0.5)
    sd.update(extra or {})
    return sd


def test_checkpoint_scales_are_loaded_and_fitted_to_each_backends_granularity():
    model = _model()
    model.load_hf_state_dict(_with_scales(model, per_head=True))
    assert resolve_kv_scale_source(model, "auto") == "checkpoint"
    layers = sorted(attention_layers(model).items())
    per_head = {name: name == layers[0][0] for name, _ in layers}  # layer 0 per head, the rest per tensor
    sources = attach_kv_scales(model, torch.float8_e4m3fn, "auto", per_head, quant_query={layers[0][0]: True})
    assert set(sources.values()) == {"checkpoint"}
    for i, (name, layer) in enumerate(layers):
        h = layer.num_kv_heads
        want_k = torch.arange(1, h + 1) * 0.01 * (i + 1)
        if per_head[name]:
            assert torch.allclose(layer.k_scale, want_k) and layer.v_scale.shape == (h,)
            assert torch.allclose(layer.v_scale, torch.full((h,), 0.03 * (i + 1)))
            assert float(layer.q_scale) == 0.5  # its backend reads fp8 queries
        else:  # per-head checkpoint scales for a per-tensor backend: their maximum
            assert layer.k_scale.shape == () and torch.isclose(layer.k_scale, want_k.max())
            assert not hasattr(layer, "q_scale")
        assert not layer.kv_scales_pending


def test_without_checkpoint_scales_auto_calibrates_and_checkpoint_is_refused():
    model = _model()
    assert resolve_kv_scale_source(model, "auto") == "first_batch"
    with pytest.raises(ValueError, match="--kv-scales checkpoint: the checkpoint carries k_scale / v_scale for 0 of"):
        resolve_kv_scale_source(model, "checkpoint")


def test_malformed_scale_tensors_are_refused_naming_the_key():
    model = _model()
    path = next(p for p, m in model.named_modules() if m is next(iter(attention_layers(model).values())))
    bad = _with_scales(model, per_head=False, extra={f"{path}.k_scale": torch.ones(7),
                                                    "model.norm.self_attn.v_scale": torch.ones(())})
    with pytest.raises(WeightLoadError) as err:
        model.load_hf_state_dict(bad)
    assert f"{path}.k_scale: shape [7], need [] (per tensor) or" in str(err.value)
    assert "model.norm.self_attn.v_scale: model.norm.self_attn is not a paged-K/V attention module" in str(err.value)


def test_a_run_with_checkpoint_scales_says_so_in_its_table():
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.step.scheduler_output import SamplingParams

    model = _model()
    model.load_hf_state_dict(_with_scales(model, per_head=False, extra=None))
    args = SimpleNamespace(model="tiny-llama", backend="torch_native", block_size=16, seed=0, max_model_len=64,
                           max_num_seqs=2, max_num_batched_tokens=32, num_blocks=None, kv_cache_dtype="fp8_e4m3",
                           kv_scales="auto", device="cpu")
    setup = build_engine(args, requests=False, model=model)
    assert setup.kv_cache == {"dtype": "fp8_e4m3", "scales": "checkpoint", "granularity": "per KV head"}
    setup.engine.add_request("r0", list(range(3, 12)), SamplingParams(temperature=0.0, max_tokens=2))
    setup.engine.run()
    layer = next(iter(attention_layers(model).values()))
    assert torch.allclose(layer.k_scale, torch.full((layer.num_kv_heads,), 0.02))  # not recalibrated
