"""The flash_attn (FA3) and flashinfer fp8 lowerings have teeth: copies of their REAL impls
(over the CPU emulators of the kernels' documented contracts) that drop FA3's ``*_descale``,
ignore ``q_descale``, use KV head 0's descale for every head, drop FlashInfer's per-tensor
``k_scale`` / ``v_scale`` floats, or skip the per-head ``v_scale`` fold each fail the fp8
conformance case; the real impls pass it."""

from __future__ import annotations

import pytest

from attnplug.backends.emulators import FlashAttn3EmulatedBackend, FlashInferEmulatedBackend
from attnplug.backends.emulators.backends import FlashAttn3EmulatedImpl
from attnplug.backends.flashinfer.impl import FlashInferImpl
from attnplug.plugins.conformance import checks
from attnplug.plugins.conformance.cases import CASES
from attnplug.plugins.conformance.harness import run_case


class _FA3DropsDescales(FlashAttn3EmulatedImpl):
    def _attend(self, *args, scales=None, **kwargs):
        return super()._attend(*args, scales=None, **kwargs)


class _FA3IgnoresQDescale(FlashAttn3EmulatedImpl):
    def _attend(self, *args, scales=None, **kwargs):
        return super()._attend(*args, scales=(scales[0] * 0 + 1, *scales[1:]) if scales else None, **kwargs)


class _FA3HeadZeroDescale(FlashAttn3EmulatedImpl):
    def _attend(self, *args, scales=None, **kwargs):
        return super()._attend(*args, scales=tuple(s[:1].expand_as(s) for s in scales) if scales else None,
                               **kwargs)


class _FIDropsScaleFloats(FlashInferImpl):
    def _fp8_scales(self, query, k_scale, v_scale):
        query, head_v, _ = super()._fp8_scales(query, k_scale, v_scale)
        return query, head_v, {}


class _FISkipsPerHeadVFold(FlashInferImpl):
    def _fp8_scales(self, query, k_scale, v_scale):
        query, _, kwargs = super()._fp8_scales(query, k_scale, v_scale)
        return query, None, kwargs


def _with_impl(base, impl):
    return type(f"Broken{impl.__name__}", (base,), {"get_impl_cls": classmethod(lambda cls: impl)})


def _problems(backend, case_name):
    case = next(c for c in CASES if c.name == case_name)
    run = run_case(backend, case, "cpu", backend.get_supported_kernel_block_size(case.block_size))
    assert run.error is None, run.error
    reference = None if backend.supports_quant_query_input else run_case(
        __import__("attnplug.backends.torch_native", fromlist=["x"]).TorchNativeBackend, case, "cpu",
        case.kernel_block_size or case.block_size)
    return checks.check_outputs(run, reference, name_blocks=False)


PLANTED = [
    (FlashAttn3EmulatedBackend, _FA3DropsDescales, "fp8_e4m3_per_head"),
    (FlashAttn3EmulatedBackend, _FA3IgnoresQDescale, "fp8_e4m3_per_head"),
    (FlashAttn3EmulatedBackend, _FA3HeadZeroDescale, "fp8_e4m3_per_head"),
    (FlashInferEmulatedBackend, _FIDropsScaleFloats, "fp8_e5m2_per_tensor"),
    (FlashInferEmulatedBackend, _FISkipsPerHeadVFold, "fp8_e4m3_per_head"),
]


@pytest.mark.parametrize("base, impl, case", PLANTED, ids=[p[1].__name__.strip("_") for p in PLANTED])
def test_a_planted_fp8_lowering_bug_fails_the_fp8_case(base, impl, case):
    problems = _problems(_with_impl(base, impl), case)
    assert problems and "differ" in problems[0], problems


@pytest.mark.parametrize("backend, case", [(FlashAttn3EmulatedBackend, "fp8_e4m3_per_head"),
                                           (FlashInferEmulatedBackend, "fp8_e4m3_per_head"),
                                           (FlashInferEmulatedBackend, "fp8_e5m2_per_tensor")],
                         ids=["fa3-per-head", "flashinfer-per-head", "flashinfer-per-tensor"])
def test_the_real_fp8_lowerings_pass(backend, case):
    assert _problems(backend, case) == []
