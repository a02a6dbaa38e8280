"""ALiBi in torch_native: the ``alibi_*`` conformance cases pass against the dense oracle's
``- slope_h * (query position - key position)``, and copies of the impl that drop the bias,
flip its sign, or use head 0's slope for every head fail them; a cascade step on an ALiBi
layer is refused, never run without the bias."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.torch_native.impl import TorchNativeAttentionImpl
from attnplug.core.contracts import AttentionLayerConfig
from attnplug.plugins.conformance import checks
from attnplug.plugins.conformance.cases import CASES
from attnplug.plugins.conformance.harness import run_case


class _DropsAlibi(TorchNativeAttentionImpl):
    def _alibi(self, *args):
        return None


class _FlipsAlibi(TorchNativeAttentionImpl):
    def _alibi(self, *args):
        got = super()._alibi(*args)
        return None if got is None else (-got[0], got[1])


class _HeadZeroSlope(TorchNativeAttentionImpl):
    def _alibi(self, *args):
        got = super()._alibi(*args)
        return None if got is None else (got[0][:1].expand_as(got[0]), got[1])


def _problems(impl, case_name):
    backend = type(f"B{impl.__name__}", (TorchNativeBackend,), {"get_impl_cls": classmethod(lambda cls: impl)})
    case = next(c for c in CASES if c.name == case_name)
    run = run_case(backend, case, "cpu", case.block_size)
    assert run.error is None, run.error
    return checks.check_outputs(run, None, name_blocks=False)


@pytest.mark.parametrize("case", ["alibi_gqa", "alibi_sliding_chunked"])
def test_torch_native_passes_the_alibi_cases(case):
    assert _problems(TorchNativeAttentionImpl, case) == []


@pytest.mark.parametrize("impl", [_DropsAlibi, _FlipsAlibi, _HeadZeroSlope], ids=lambda c: c.__name__.strip("_"))
def test_a_planted_alibi_bug_fails_the_alibi_case(impl):
    problems = _problems(impl, "alibi_gqa")
    assert problems and "differ from the dense float64 oracle" in problems[0], problems


def test_selection_refuses_alibi_where_undeclared_and_slopes_are_checked():
    from attnplug.backends.flashinfer.backend import FlashInferBackend  # declares no ALiBi
    from attnplug.core.errors import BackendUnsupportedError

    layer = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=32, use_alibi=True)
    assert TorchNativeBackend.validate_configuration(layer) == []
    assert any("ALiBi" in r for r in FlashInferBackend.validate_configuration(layer))
    with pytest.raises(BackendUnsupportedError, match="alibi_slopes must be \\[4\\] float32"):
        TorchNativeAttentionImpl(4, 32, 0.1, 2, alibi_slopes=torch.ones(3))
