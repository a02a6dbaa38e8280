"""Malformed capability declarations are refused at registration, each naming the attribute."""

from __future__ import annotations

import pytest
import torch

from attnplug.core.errors import PluginValidationError
from attnplug.plugins.registry import BUILTIN_SOURCE, BackendRegistry, check_backend_class


def _raises():
    raise RuntimeError("boom")


@pytest.mark.parametrize("attrs, what", [
    ({"supported_devices": None}, "supported_devices must be a tuple of device type names (str), got None"),
    ({"supported_devices": "cpu"}, "supported_devices must be a tuple"),
    ({"supported_dtypes": ("float32",)}, "supported_dtypes must be a tuple of torch dtypes, got ('float32',)"),
    ({"supported_head_sizes": (64, 0)}, "supported_head_sizes must be a tuple of positive ints or None"),
    ({"supported_kernel_block_sizes": (True,)}, "supported_kernel_block_sizes must be a tuple of positive ints"),
    ({"supported_attn_types": ("decoder", 3)}, "supported_attn_types must be a tuple of AttentionType members"),
    ({"features": classmethod(lambda cls: _raises())}, "features() raised RuntimeError: boom"),
    ({"features": classmethod(lambda cls: {"sliding_window": "yes"})}, "features() must return a dict of str -> bool"),
])
def test_malformed_declarations_are_problems(make_backend, attrs, what):
    cls = make_backend("bad", **attrs)
    name, problems = check_backend_class(cls)
    assert name == "bad" and any(what in p for p in problems), problems
    reg = BackendRegistry()
    with pytest.raises(PluginValidationError, match="bad"):
        reg.add(cls, BUILTIN_SOURCE)
    assert "bad" not in reg and len(reg) == 0


def test_well_formed_declarations_pass(make_backend):
    cls = make_backend("good", supported_head_sizes=[64, 128], supported_kernel_block_sizes=None,
                       supported_dtypes=(torch.float32,), supported_devices=["cpu"])
    assert check_backend_class(cls) == ("good", [])
