"""A backend whose impl constructor raises is one clear error naming the backend and the
layer, for every model family, never a traceback from inside the model build."""

from __future__ import annotations

import pytest

from attnplug.core.errors import BackendUnsupportedError
from attnplug.plugins import get_backend
from attnplug.runner.models import build_model
from attnplug.runner.models.presets import preset_config


class Boom(RuntimeError):
    pass


def raising(real):
    class Broken(real):
        @classmethod
        def get_name(cls):
            return "broken_" + real.get_name()

        @classmethod
        def get_impl_cls(cls):
            class Impl(real.get_impl_cls()):
                def __init__(self, *a, **k):
                    raise Boom("no kernels here")
            return Impl
    return Broken


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-hybrid"])
@pytest.mark.parametrize("which", ["attention", "mamba"])
def test_an_impl_that_raises_is_named(preset, which):
    cfg = preset_config(preset)
    attn, mamba = get_backend("torch_native"), get_backend("mamba2_torch")
    if which == "mamba" and preset == "tiny-llama":
        pytest.skip("no Mamba layers")

    def pick(name, layer_cfg):
        is_mamba = type(layer_cfg).__name__ == "MambaLayerConfig"
        real = mamba if is_mamba else attn
        return raising(real) if (which == "mamba") == is_mamba else real

    with pytest.raises(BackendUnsupportedError) as info:
        build_model(cfg, backend_for_layer=pick)
    msg = str(info.value)
    assert "broken_" in msg and "Boom: no kernels here" in msg and "layer" in msg
    assert isinstance(info.value.__cause__, Boom)
