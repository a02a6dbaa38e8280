"""The capability vocabulary in selection: a layer's needs (sinks, ALiBi, sqrt-ALiBi,
non-causal, batch invariance) that a backend does not declare refuse it, one reason each,
explicitly chosen or automatic; ``BackendCapabilities`` reads the same declarations."""

from __future__ import annotations

import pytest

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.core.capabilities import BackendCapabilities, Feature, ScaleGranularity, layer_needs
from attnplug.core.contracts import AttentionLayerConfig
from attnplug.core.errors import BackendUnsupportedError
from attnplug.plugins.selection import select_backend

NEEDY = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=64, has_sinks=True, use_alibi=True,
                             causal=False, batch_invariant=True)


def test_layer_needs_names_each_feature():
    assert set(layer_needs(NEEDY)) == {Feature.SINKS, Feature.ALIBI, Feature.NON_CAUSAL, Feature.BATCH_INVARIANT}
    sqrt = AttentionLayerConfig(4, 2, 64, use_alibi=True, use_alibi_sqrt=True, sliding_window=8)
    assert set(layer_needs(sqrt)) == {Feature.ALIBI_SQRT, Feature.SLIDING_WINDOW}
    assert layer_needs(AttentionLayerConfig(4, 2, 64)) == {}


def test_an_explicit_choice_is_refused_with_every_missing_feature():
    with pytest.raises(BackendUnsupportedError) as exc:
        select_backend(NEEDY, "full_attention", cli_choice="torch_native", env={})
    reasons = exc.value.reasons
    assert not any("ALiBi" in r for r in reasons)  # torch_native declares ALiBi
    assert "non-causal attention not supported" in reasons
    assert "batch-invariant attention not supported" in reasons
    assert not any("sinks" in r for r in reasons)  # torch_native declares sinks
    assert "chosen explicitly by --backend" in str(exc.value)
    with pytest.raises(BackendUnsupportedError) as exc:  # flash_attn declares neither sinks nor ALiBi
        select_backend(NEEDY, "full_attention", cli_choice="flash_attn", env={})
    assert {"ALiBi position biases not supported", "attention sinks (per-head sink logits) not supported",
            "non-causal attention not supported"} <= set(exc.value.reasons)


def test_automatic_selection_skips_backends_without_sinks():
    from attnplug.backends.cpu_sdpa import CpuSdpaBackend
    from tests.plugins.conftest import registry_of

    layer = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=64, has_sinks=True)
    no_sinks = type("NoSinks", (CpuSdpaBackend,), {"supports_sink": classmethod(lambda cls: False)})  # named cpu_sdpa
    assert "attention sinks (per-head sink logits) not supported" in no_sinks.validate_configuration(layer)
    registry = registry_of(no_sinks, TorchNativeBackend)  # cpu_sdpa first in the CPU priority
    picked = select_backend(layer, "full_attention", env={}, registry=registry)
    assert picked.name == "torch_native" and [r.backend for r in picked.rejections] == ["cpu_sdpa"]
    assert select_backend(layer, "full_attention", env={}).name == "cpu_sdpa"  # the real one takes sinks


def test_capabilities_are_the_declarations():
    caps = BackendCapabilities.of(TorchNativeBackend)
    assert caps.features == frozenset({Feature.SLIDING_WINDOW, Feature.LOGITS_SOFT_CAP, Feature.MQA_GQA,
                                       Feature.SINKS, Feature.ALIBI})
    assert caps.kv_cache_dtypes == ("auto", "fp8_e4m3", "fp8_e5m2") and caps.cudagraph == "NEVER"
    assert caps.scale_granularities == (ScaleGranularity.PER_TENSOR, ScaleGranularity.PER_HEAD)
    plain = type("NoFp8", (TorchNativeBackend,), {"supported_kv_cache_dtypes": ("auto",)})
    assert BackendCapabilities.of(plain).kv_cache_dtypes == ("auto",)
    assert BackendCapabilities.of(plain).scale_granularities == ()
    per_tensor = type("Fp8", (TorchNativeBackend,), {"supported_kv_cache_dtypes": ("auto", "fp8_e4m3"),
                                                     "supports_per_head_kv_scales": False})
    assert BackendCapabilities.of(per_tensor).scale_granularities == (ScaleGranularity.PER_TENSOR,)
    d = caps.to_dict()
    assert d["features"]["sinks"] is True and d["features"]["alibi_sqrt"] is False and set(d["features"]) == {
        f.value for f in Feature}
