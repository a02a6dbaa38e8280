"""The fp8 KV-cache cases have teeth: a backend that ignores the scales (on read and write,
or only on read) or uses KV head 0's scale for every head FAILS ``attnplug check``, naming
the case; one that declares no fp8 is skipped for them, and selection refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent


def _run_suite(pytester, backend: str, keyword: str):
    pytester.syspathinsert(HERE)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                        "--attnplug-backend", backend, "-k", keyword)


BROKEN = [("IgnoresKVScales", "test_kv_written_exactly_at_slot_mapping"),
          ("ReadIgnoresKVScales", "test_outputs_match_reference"),
          ("HeadZeroKVScale", "test_outputs_match_reference")]


def _broken(cls: str):
    import importlib
    import sys

    sys.path.insert(0, str(HERE))
    try:
        return getattr(importlib.import_module("broken_kv_scales"), cls)
    finally:
        sys.path.remove(str(HERE))


@pytest.mark.parametrize("cls, test", BROKEN, ids=[b[0] for b in BROKEN])
def test_wrong_kv_scales_fail_the_fp8_checks(cls, test):
    """In process (fast): the harness and the check the suite's test calls."""
    from attnplug.plugins.conformance import checks
    from attnplug.plugins.conformance.cases import CASES
    from attnplug.plugins.conformance.harness import run_case

    backend = _broken(cls)
    case = next(c for c in CASES if c.name == "fp8_e4m3_per_head")
    run = run_case(backend, case, "cpu", backend.get_supported_kernel_block_size(case.block_size))
    assert run.error is None, run.error
    found = (checks.check_cache_writes(run, backend) if test == "test_kv_written_exactly_at_slot_mapping"
             else checks.check_outputs(run, None, name_blocks=False))
    assert found and ("differ" in found[0] or "do not hold their token's K/V" in found[0]), found
    from attnplug.backends.torch_native import TorchNativeBackend

    good = run_case(TorchNativeBackend, case, "cpu", 16)  # the same case passes on the correct backend
    assert not checks.check_outputs(good, None) and not checks.check_cache_writes(good, good.backend)


@pytest.mark.slow
@pytest.mark.parametrize("cls, test", BROKEN, ids=[b[0] for b in BROKEN])
def test_wrong_kv_scales_fail_attnplug_check_naming_the_case(pytester, cls, test):
    result = _run_suite(pytester, f"broken_kv_scales:{cls}", "fp8_e4m3_per_head and (outputs or written)")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines([f"FAILED *{test}?broken_kv_scales:{cls}-fp8_e4m3_per_head]*"])
    assert "case 'fp8_e4m3_per_head' on backend" in result.stdout.str()


def test_a_backend_without_fp8_is_skipped_and_refused():
    NoFp8 = _broken("NoFp8")
    from attnplug.core.contracts import AttentionLayerConfig
    from attnplug.plugins.conformance.cases import CASES
    from attnplug.plugins.conformance.requirements import assess

    fp8 = [c for c in CASES if c.kv_cache_dtype != "auto"]
    assert fp8 and all(assess(NoFp8, c, "cpu").skip_reasons == (
        f"the case needs kv_cache_dtype {c.kv_cache_dtype}; the backend declares supported_kv_cache_dtypes ['auto']",)
        for c in fp8)

    layer = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=32, kv_cache_dtype=torch.float8_e4m3fn)
    assert NoFp8.validate_configuration(layer) == [
        "kv_cache_dtype fp8_e4m3 not supported (supported: auto)"]
