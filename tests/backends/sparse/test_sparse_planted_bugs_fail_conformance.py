"""The torch_native selector and consumer pass their sparse conformance families; four
planted bugs (top-k over the whole batch instead of per request, a future token selected,
ties to the later position, -1 read as position 0) each fail, naming the case (also through ``attnplug check``)."""

from __future__ import annotations

from attnplug.backends.sparse.torch_native.backend import TorchNativeIndexerBackend, TorchNativeSparseMLABackend
from attnplug.plugins.conformance import sparse_checks
from attnplug.plugins.conformance.sparse_cases import SELECTOR_CASES, SPARSE_MLA_CASES
from attnplug.plugins.conformance.sparse_harness import SelectorStep, SparseMLAStep

import buggy_sparse


def _selector_problems(backend, case):
    step = SelectorStep(backend, case, "cpu")
    run = step.run()
    return sparse_checks.check_selection(step, run) + sparse_checks.check_key_cache(run)


def _consumer_problems(backend, case):
    step = SparseMLAStep(backend, case, "cpu")
    return sparse_checks.check_sparse_output(step, step.run())


def test_reference_backends_pass_every_check():
    for case in SELECTOR_CASES:
        assert _selector_problems(TorchNativeIndexerBackend, case) == [], case.name
    for case in SPARSE_MLA_CASES:
        assert _consumer_problems(TorchNativeSparseMLABackend, case) == [], case.name


def test_topk_over_the_whole_batch_fails_naming_the_case():
    problems = _selector_problems(buggy_sparse.BatchWideTopK, SELECTOR_CASES[0])
    assert any("case 'decode_only': query token" in p and "not the top-k of its own request" in p
               for p in problems), problems


def test_a_future_token_selected_fails_naming_the_case():
    problems = _selector_problems(buggy_sparse.SelectsFuture, SELECTOR_CASES[1])
    assert any("case 'prefill_fresh': query token" in p and "future token" in p for p in problems), problems


def test_ties_broken_toward_the_later_position_fail_the_ties_case():
    problems = _selector_problems(buggy_sparse.LaterWinsTies, next(c for c in SELECTOR_CASES if c.name == "ties"))
    assert any("case 'ties': query token" in p and "lower position first" in p for p in problems), problems


def test_minus_one_read_as_position_zero_fails_naming_the_case():
    problems = _consumer_problems(buggy_sparse.MinusOneAsZero, SPARSE_MLA_CASES[0])
    assert any("case 'decode_only'" in p and "max abs error" in p for p in problems), problems


def test_attnplug_check_reports_the_failing_case(capsys):
    from attnplug.runner.commands.check import main

    bug, test_name, case = "SelectsFuture", "test_selector_topk_matches_reference", "prefill_fresh"
    rc = main([f"buggy_sparse:{bug}", "--device", "cpu", "-k", test_name])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert f"{test_name}[buggy_sparse:{bug}-{case}]" in out and f"case '{case}'" in out, out


def test_attnplug_check_passes_the_reference_backends(capsys):
    from attnplug.runner.commands.check import main

    rc = main(["torch_native_indexer", "torch_native_sparse_mla", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
