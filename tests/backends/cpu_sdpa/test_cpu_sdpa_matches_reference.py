"""``cpu_sdpa`` against the ``torch_native`` reference.

* the whole conformance catalog passes, its only skips the limitations every attention
  backend of its kind has (MLA / state cases, property mode off, "undeclared feature"
  checks of features it declares);
* the fast paths really run: on decode, ragged decode, chunked prefill and sliding-window
  steps with NaN-poisoned free blocks, the result matches ``torch_native`` with the
  reference path made to raise (so no case silently falls back to it) — the compiled
  paged kernel (checked to be called), the SDPA path on gathered blocks
  (``CpuSdpaGatherBackend``: checked not to call the kernel), and ``CpuSdpaBackend`` with
  the compiled module gone (the fallback a build without a C compiler runs).
"""

from __future__ import annotations

import re

import pytest
import torch

from attnplug.backends.cpu_sdpa import CpuSdpaBackend, paged
from attnplug.backends.cpu_sdpa.backend import CpuSdpaGatherBackend
from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.torch_native.impl import TorchNativeAttentionImpl
from attnplug.cache_groups.specs import FullAttentionSpec, SlidingWindowSpec
from attnplug.core import BuilderConfig, CommonAttentionMetadata

pytest_plugins = ["pytester"]

EXPECTED_SKIP = re.compile(
    r"the backend declares '(sliding_window|logits_soft_cap|mqa_gqa)'; the cases test it"
    r"|the case needs '(sinks|alibi)'; the backend declares features\(\)\['(sinks|alibi)'\] = False"
    r"|the backend serves 'attention' caches"
    r"|property mode is off")


@pytest.mark.slow
def test_conformance_catalog_passes(pytester):
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs", "--pyargs", "attnplug.plugins.conformance",
                                          "--attnplug-device", "cpu", "--attnplug-backend", "cpu_sdpa")
    out = result.parseoutcomes()
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert out.get("passed", 0) >= 100 and not out.get("failed") and not out.get("errors")
    skips = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert not [s for s in skips if not EXPECTED_SKIP.search(s)], skips


# (num_computed_tokens, num_scheduled_tokens) per request: equal decodes, ragged decodes,
# decodes + a chunked-prefill continuation + a fresh prompt
STEPS = {
    "decode_equal": [(9, 1), (9, 1), (9, 1)],
    "decode_ragged": [(3, 1), (17, 1), (8, 1)],
    "mixed": [(12, 1), (5, 1), (6, 7), (0, 9)],
}


def _run(backend, step, window, num_heads=4, num_kv_heads=2, head_size=16, block_size=4, cache_dtype=None,
         layer=None, logits_soft_cap=None):
    torch.manual_seed(0)
    lens = [c + s for c, s in step]
    width = max(-(-n // block_size) for n in lens) + 1
    table, next_id = torch.zeros(len(step), width, dtype=torch.int32), 1
    for r, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            table[r, b] = next_id
            next_id += 1
    cm = CommonAttentionMetadata.from_lengths([c for c, _ in step], [s for _, s in step], table, block_size)
    spec = (FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size) if window is None
            else SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                                   sliding_window=window))
    builder = backend.get_builder_cls()(spec, ["l0"], BuilderConfig(len(step), 64, 64), "cpu")
    impl = backend.get_impl_cls()(num_heads, head_size, head_size ** -0.5, num_kv_heads, sliding_window=window,
                                  logits_soft_cap=logits_soft_cap)
    kv = torch.randn(backend.get_kv_cache_shape(next_id + 2, block_size, num_kv_heads, head_size))
    kv[0] = float("nan")  # the null block and the free blocks past every request: poison
    kv[next_id:] = float("nan")
    if cache_dtype is not None:
        kv = kv.to(cache_dtype)
    T = sum(s for _, s in step)
    q, k, v = torch.randn(T, num_heads, head_size), torch.randn(T, num_kv_heads, head_size), \
        torch.randn(T, num_kv_heads, head_size)
    return impl.forward(layer, q, k, v, kv, builder.build(0, cm), torch.zeros(T, num_heads, head_size))


def _path(monkeypatch, path: str):
    """The backend class for ``path`` with the kernel's calls counted (``calls[0]``)."""
    if path == "kernel" and not paged.available():
        pytest.skip("the compiled paged kernel is not built")
    if path == "no_module":
        monkeypatch.setattr(paged, "_paged", None)
    calls, real = [0], paged.paged_attention_checked  # what the impl calls after its checks

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(paged, "paged_attention_checked", counted)
    return (CpuSdpaGatherBackend if path == "gather" else CpuSdpaBackend), calls


@pytest.mark.parametrize("path", ["kernel", "gather", "no_module"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_fast_path_matches_torch_native(step, window, path, monkeypatch):
    expected = _run(TorchNativeBackend, STEPS[step], window)

    def no_fallback(*args, **kwargs):
        raise AssertionError("cpu_sdpa fell back to the torch_native path")

    backend, calls = _path(monkeypatch, path)
    monkeypatch.setattr(TorchNativeAttentionImpl, "forward", no_fallback)
    got = _run(backend, STEPS[step], window)
    assert calls[0] == (path == "kernel")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_soft_cap_runs_the_kernel_and_matches_torch_native(path, monkeypatch):
    """A soft-capped layer: the kernel caps in place; the SDPA path (no soft-cap) runs the
    reference (so only the kernel path forbids it)."""
    step = STEPS["mixed"]
    expected = _run(TorchNativeBackend, step, None, logits_soft_cap=2.0)
    backend, calls = _path(monkeypatch, path)
    if path == "kernel":
        monkeypatch.setattr(TorchNativeAttentionImpl, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    got = _run(backend, step, None, logits_soft_cap=2.0)
    assert calls[0] == (path == "kernel")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", ["mixed", "decode_ragged"])  # decode_ragged: the length-bucket path
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_fast_path_matches_torch_native(cache_dtype, step, monkeypatch):
    """An fp8 cache with per-KV-head k_scale and a per-tensor v_scale: written and read with
    the scales on the fast path, equal to torch_native's dequantising reference."""
    from types import SimpleNamespace

    layer = SimpleNamespace(k_scale=torch.tensor([0.02, 0.05]), v_scale=torch.tensor(0.03))
    expected = _run(TorchNativeBackend, STEPS[step], None, cache_dtype=cache_dtype, layer=layer)
    monkeypatch.setattr(TorchNativeAttentionImpl, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    got = _run(CpuSdpaBackend, STEPS[step], None, cache_dtype=cache_dtype, layer=layer)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_paged_kernel_is_built_wherever_the_step_kernels_are():
    """Both extensions are optional (pyproject.toml), so a compile error in ``_paged.pyx``
    would only show as skipped kernel tests; where the C compiler built the step compiler's
    module it must have built this one too."""
    from attnplug.runner.step.fast import NATIVE

    if NATIVE is None:
        pytest.skip("no compiled extension at all (no C compiler at install)")
    assert paged.available(), paged.unsupported(torch.float32, torch.float32, 64)
