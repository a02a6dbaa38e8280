"""The conformance suite on the CPU runs the REAL flash_attn and flashinfer builders and
impls, with only the kernel call emulated (``attnplug.backends.emulators``), in one
session (the torch_native reference runs are shared):

* FlashAttention 3 (any page size) and FlashInfer on the built-in catalog;
* FlashAttention 2 (pages of 256) on ``cases_pages_256.json`` (the catalog's small
  blocks are skipped for it: a declared limitation).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CASES = Path(__file__).resolve().parent / "cases_pages_256.json"
FA3 = "attnplug.backends.emulators:FlashAttn3EmulatedBackend"
FA2 = "attnplug.backends.emulators:FlashAttn2EmulatedBackend"
FI = "attnplug.backends.emulators:FlashInferEmulatedBackend"


def test_emulated_flash_backends_pass_the_conformance_suite(pytester):
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-v", "--durations=5", "--pyargs", "attnplug.plugins.conformance",
        "--attnplug-backend", FA3, "--attnplug-backend", FI, "--attnplug-backend", FA2,
        "--attnplug-cases", str(CASES))
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK, out
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 200 and not outcomes.get("failed") and not outcomes.get("errors"), outcomes
    for backend in (FA3, FI):
        for case in ("mixed", "window_5_block_4", "softcap_window", "block_64_kernel_16", "prefill_only"):
            assert f"test_outputs_match_reference[{backend}-{case}] PASSED" in out, (backend, case)
            assert f"test_kv_written_exactly_at_slot_mapping[{backend}-{case}] PASSED" in out, (backend, case)
    for case in ("fa2_pages_256_mixed", "fa2_pages_256_window_softcap", "fa2_pages_512_kernel_256_fp16"):
        assert f"test_outputs_match_reference[{FA2}-{case}] PASSED" in out, case
    assert f"test_update_block_table_equals_fresh_build[{FA3}-mixed] PASSED" in out
    # fp8 KV caches: FA3 (e4m3, per-head descales, fp8 queries) and FlashInfer (both dtypes)
    assert f"test_outputs_match_reference[{FA3}-fp8_e4m3_per_head] PASSED" in out
    for case in ("fp8_e4m3_per_head", "fp8_e5m2_per_tensor"):
        assert f"test_outputs_match_reference[{FI}-{case}] PASSED" in out, case
        assert f"test_kv_written_exactly_at_slot_mapping[{FI}-{case}] PASSED" in out, case
    for backend in (FA3, FI, FA2):
        assert f"test_builder_is_reentrant[{backend}] PASSED" in out, backend
        assert f"test_kv_layout_matches_cache_shape[{backend}] PASSED" in out, backend
    assert f"test_deterministic[{FA2}-fa2_pages_256_mixed] PASSED" in out
