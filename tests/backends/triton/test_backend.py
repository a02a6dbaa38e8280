"""TritonBackend declarations, availability, validation reasons, registration and selection."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys

import pytest
import torch

import attnplug.backends.triton.backend as backend_mod
import attnplug.backends.triton.metadata as metadata_mod
import attnplug.backends.triton.runtime as runtime
from attnplug.backends import BUILTIN_BACKENDS
from attnplug.backends.triton import TritonAttentionImpl, TritonBackend
from attnplug.core.contracts import AttentionLayerConfig, AttentionType
from attnplug.core.errors import BackendUnsupportedError
from attnplug.plugins import get_backend
from attnplug.plugins.selection import select_backend

LAYER = AttentionLayerConfig(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=16)


def _compiled_mode_without_cuda(monkeypatch, env_set: bool = False):
    for mod in (runtime, backend_mod):
        monkeypatch.setattr(mod, "interpreting", lambda: False)
    monkeypatch.setattr(runtime, "cuda_available", lambda: False)
    if env_set:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_registered_as_a_builtin():
    assert "triton" in BUILTIN_BACKENDS and get_backend("triton") is TritonBackend


def test_kernel_block_sizes_map_manager_blocks():
    assert [TritonBackend.get_supported_kernel_block_size(b) for b in (16, 32, 64, 128, 48, 256, 8, 4)] == \
        [16, 32, 64, 64, 16, 64, None, None]


def test_interpreter_mode_declares_cpu_and_no_bfloat16():
    assert TritonBackend.is_available() == (True, "")
    assert TritonBackend.supported_devices == ("cuda", "cpu")
    assert torch.bfloat16 not in TritonBackend.supported_dtypes
    reasons = TritonBackend.validate_configuration(AttentionLayerConfig(8, 2, 64, dtype=torch.bfloat16))
    assert any("bfloat16 is not supported under TRITON_INTERPRET=1" in r for r in reasons), reasons
    assert TritonBackend.validate_configuration(AttentionLayerConfig(8, 2, 64, dtype=torch.float16)) == []


def test_compiled_mode_without_cuda_says_why(monkeypatch):
    _compiled_mode_without_cuda(monkeypatch)
    ok, why = TritonBackend.is_available()
    assert not ok and "no CUDA device" in why and "TRITON_INTERPRET=1" in why
    assert TritonBackend.supported_devices == ("cuda",) and torch.bfloat16 in TritonBackend.supported_dtypes
    reasons = TritonBackend.validate_configuration(LAYER)
    assert any(r.startswith("not available on this machine") for r in reasons)
    assert sum("TRITON_INTERPRET=1" in r for r in reasons) == 1, f"the remedy is said once: {reasons}"


def test_variable_set_after_import_is_explained(monkeypatch):
    _compiled_mode_without_cuda(monkeypatch, env_set=True)
    ok, why = TritonBackend.is_available()
    assert not ok and "set after triton was imported" in why


@pytest.mark.parametrize("triton_version, numpy_version, broken", [
    ("3.6.0", "2.5.5", True), ("3.6.0", "2.4.0", True), ("3.6.0", "2.3.4", False), ("3.7.0", "2.5.5", False),
    ("3.10.0", "2.5.5", False)])
def test_old_triton_interpreter_with_new_numpy_is_explained(monkeypatch, triton_version, numpy_version, broken):
    """Triton < 3.7's interpreter calls int() on 1-element arrays; NumPy >= 2.4 refuses it."""
    import numpy
    import triton

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    why = runtime.interpreter_incompatibility()
    assert (why is not None) == broken
    if broken:
        assert f"triton {triton_version}" in why and "triton >= 3.7 or numpy < 2.4" in why
        ok, reason = TritonBackend.is_available()  # this process runs the interpreter, without CUDA
        assert not ok and reason == why
    else:
        assert TritonBackend.is_available() == (True, "")


def test_no_triton_package(monkeypatch):
    monkeypatch.setattr(runtime, "triton_import_error", lambda: "importing triton failed (ImportError: nope)")
    ok, why = TritonBackend.is_available()
    assert not ok and "pip install 'attnplug[triton]'" in why


def test_validate_configuration_gives_every_reason():
    layer = AttentionLayerConfig(num_heads=6, num_kv_heads=4, head_size=300, dtype=torch.float16, block_size=8,
                                 kv_cache_dtype=torch.float32)
    text = "\n".join(TritonBackend.validate_configuration(layer))
    for needle in ("head_size 300 not supported", "block_size 8 is not a multiple", "num_heads 6 is not a multiple",
                   "kv_cache_dtype torch.float32 differs"):
        assert needle in text, text


@pytest.mark.parametrize("sm, cache, refused", [(80, torch.float8_e4m3fn, True), (86, torch.float8_e4m3fn, True),
                                                (89, torch.float8_e4m3fn, False), (90, torch.float8_e4m3fn, False),
                                                (80, torch.float8_e5m2, False), (80, None, False)])
def test_an_fp8_e4m3_cache_is_refused_below_sm89(monkeypatch, sm, cache, refused):
    """Triton cannot convert to float8e4nv below sm_89 (the KV write fails to compile for
    sm_80: ``aot_check --full``, session 18): the backend says so instead."""
    monkeypatch.setattr(backend_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(backend_mod, "compute_capability", lambda device: sm)
    layer = AttentionLayerConfig(8, 2, 64, dtype=torch.float16, block_size=16, kv_cache_dtype=cache, device="cuda")
    text = "\n".join(TritonBackend.validate_configuration(layer))
    assert ("needs compute capability >= 8.9" in text) is refused, text


def test_impl_rejects_what_the_kernels_cannot_do():
    with pytest.raises(BackendUnsupportedError) as exc:
        TritonAttentionImpl(6, 72, 1.0, 4, sliding_window=0, logits_soft_cap=-1.0,
                            attn_type=AttentionType.ENCODER)
    text = str(exc.value)
    for needle in ("num_heads 6", "head_size 72", "sliding_window", "logits_soft_cap", "'encoder'"):
        assert needle in text, text


def test_selectable_by_cli_env_and_config(tmp_path):
    cfg = AttentionLayerConfig(num_heads=8, num_kv_heads=2, head_size=32, device="cpu")
    assert select_backend(cfg, "full_attention", cli_choice="triton", env={}, cwd=tmp_path).name == "triton"
    assert select_backend(cfg, "sliding_window", env={"ATTNPLUG_BACKEND": "triton"}, cwd=tmp_path).name == "triton"
    (tmp_path / "attnplug.toml").write_text('[backend]\nfull_attention = "triton"\n')
    r = select_backend(cfg, "full_attention", env={}, cwd=tmp_path)
    assert (r.name, r.source) == ("triton", "config")
    auto = select_backend(cfg, "full_attention", env={}, cwd=tmp_path / "nowhere")
    assert auto.name == "cpu_sdpa", "on the CPU the interpreter is slow: the CPU default (cpu_sdpa) comes first"


def test_explicit_choice_that_cannot_serve_lists_the_reasons(tmp_path):
    cfg = AttentionLayerConfig(num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(BackendUnsupportedError, match="bfloat16 is not supported under TRITON_INTERPRET=1"):
        select_backend(cfg, "full_attention", cli_choice="triton", env={}, cwd=tmp_path)


def test_a_fresh_process_without_the_variable_reports_it_unavailable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-m", "attnplug", "backends", "--json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    (row,) = [r for r in json.loads(res.stdout)["backends"] if r["name"] == "triton"]
    assert not row["available"] and "no CUDA device" in row["unavailable_reason"]
    assert row["kernel_block_sizes"] == [16, 32, 64]


@pytest.mark.parametrize("module", [metadata_mod, backend_mod], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_module_doctests(module):
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0
