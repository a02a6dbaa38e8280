"""The conformance suite has teeth: each deliberately broken backend FAILS, and the failure
names the case; a correct backend passes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent

BROKEN = [
    # (backend class in broken_backends.py, -k selection, failing test, case named, text in the message)
    ("OffByOneSlots", "decode_only", "test_kv_written_exactly_at_slot_mapping", "decode_only",
     "real slot(s) do not hold their token's K/V: K at slot"),
    ("WritesPaddedSlots", "prefill_only", "test_kv_written_exactly_at_slot_mapping", "prefill_only",
     "slot(s) changed although no real token maps to them (a padded token's write"),
    ("IgnoresWindow", "window_5_block_4", "test_outputs_match_reference", "window_5_block_4",
     "differ from the torch_native reference"),
    ("WrongScale", "decode_only", "test_outputs_match_reference", "decode_only",
     "differ from the torch_native reference"),
    ("IgnoresScale", "scale_query_pre_attn_scalar", "test_outputs_match_reference", "scale_query_pre_attn_scalar",
     "differ from the torch_native reference"),
    ("NaNOutput", "decode_only", "test_outputs_match_reference", "decode_only",
     "are NaN"),
    ("MutatesMetadata", "decode_only", "test_builders_do_not_mutate_metadata", "decode_only",
     "build() mutated CommonAttentionMetadata.max_seq_len"),
]


def _run_suite(pytester, backend: str, keyword: str):
    pytester.syspathinsert(HERE)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                        "--attnplug-backend", backend, "-k", keyword)


@pytest.mark.parametrize("cls, keyword, test, case, needle", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_backend_fails_naming_the_case(pytester, cls, keyword, test, case, needle):
    result = _run_suite(pytester, f"broken_backends:{cls}", keyword)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines([f"FAILED *{test}?broken_backends:{cls}-{case}]*"])
    out = result.stdout.str()
    assert f"case {case!r} on backend" in out and needle in out, out


@pytest.mark.parametrize("cls, passes, fails", [
    # an impl that ignores self.scale is right at head_size ** -0.5, wrong at any other scale
    ("broken_backends:IgnoresScale", "decode_only", "scale_one"),
    # a decode that reads cdiv(W, B) window blocks is right while its window spans that many
    ("broken_backends_more:ShortWindow", "window_5_block_4", "window_6_block_4_straddles"),
])
def test_the_catalog_varies_what_a_bug_needs_to_show(pytester, cls, passes, fails):
    """Bugs the default-parameter cases cannot see: the case that varies the parameter
    (scale; window vs block size) fails, the one that does not passes."""
    result = _run_suite(pytester, cls, f"outputs and ({passes} or {fails})")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    assert result.parseoutcomes().get("passed") == 1 and result.parseoutcomes().get("failed") == 1
    result.stdout.fnmatch_lines([f"FAILED *test_outputs_match_reference?{cls}-{fails}]*"])


def test_correct_backend_passes_the_same_selection(pytester):
    result = _run_suite(pytester, "torch_native", "decode_only or window_5_block_4")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 8 and not outcomes.get("failed")


def test_without_the_option_the_suite_does_nothing(pytester):
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance")
    assert result.ret == pytest.ExitCode.OK
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0 and not outcomes.get("passed") and not outcomes.get("failed")


def test_unknown_backend_is_a_usage_error(pytester):
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                          "--attnplug-backend", "no_such_backend")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "known backends" in result.stderr.str()


@pytest.mark.parametrize("cls, why", [
    ("Unavailable", "the backend is not available on this machine: needs the moon"),
    ("HeadSize8Only", "the case needs head_size 32; the backend declares [8]"),
])
def test_a_run_that_tests_no_case_fails(pytester, cls, why):
    """Every case skipped (unavailable, or declarations that rule every case out): nothing
    was tested, so the run must not pass, and says why."""
    from attnplug.plugins.conformance.pytest_plugin import EXIT_NOTHING_TESTED

    result = _run_suite(pytester, f"broken_backends:{cls}", "decode_only or mixed or declarations")
    assert result.ret == EXIT_NOTHING_TESTED, result.stdout.str()
    assert not result.parseoutcomes().get("failed")
    out = " ".join(result.stdout.str().split())
    assert f"no case ran on backend 'broken_backends:{cls}', so nothing was tested" in out and why in out, out
    # no case test selected at all (only the declarations): nothing was meant to run, it passes
    assert _run_suite(pytester, f"broken_backends:{cls}", "declarations").ret == pytest.ExitCode.OK


def test_device_the_machine_lacks_is_a_usage_error(pytester):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                          "--attnplug-backend", "torch_native", "--attnplug-device", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--attnplug-device cuda requested but torch.cuda.is_available() is False" in result.stderr.str()
