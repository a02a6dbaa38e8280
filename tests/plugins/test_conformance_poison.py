"""The NaN poison and the silent no-write check have teeth (docs/conformance.md).

Backends that read the null block or freed window blocks, even masked, fail naming the
block read; a K/V write into a copy of the cache fails saying the step wrote none of its
slots; torch_native and the KV-cache emulators of FlashAttention / FlashInfer pass the same
cases, and the poison plan names every kind of poisoned block.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from attnplug.plugins.conformance.cases import ConformanceCase
from attnplug.plugins.conformance.harness import schedule
from attnplug.plugins.conformance.poison import PoisonPlan

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
SELECTION = "decode_only or window_5_block_4"


def _run_suite(pytester, backend: str, keyword: str = SELECTION):
    pytester.syspathinsert(HERE)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                        "--attnplug-backend", backend, "-k", keyword)


def _flat(result) -> str:
    return " ".join(result.stdout.str().split())


@pytest.mark.parametrize("cls, failing_case, passing_case", [
    ("ReadsFromKeyZero", "window_5_block_4", "decode_only"),   # freed window blocks -> the null block
    ("ReadsWholeRow", "decode_only", None),                    # the null block padding the block-table row
])
def test_masked_reads_of_poisoned_blocks_fail_naming_the_block(pytester, cls, failing_case, passing_case):
    result = _run_suite(pytester, f"broken_backends_more:{cls}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines([f"FAILED *test_outputs_match_reference?broken_backends_more:{cls}-{failing_case}]*"])
    out = _flat(result)
    assert f"case {failing_case!r} on backend" in out
    assert "are NaN: the backend read KV-cache blocks no query of the step may read" in out, out
    assert "Blocks read (1): block 0: the null block (NULL_BLOCK_ID)" in out, out
    if passing_case:  # otherwise correct: the same backend passes a case where it reads no poisoned block
        again = _run_suite(pytester, f"broken_backends_more:{cls}", f"outputs and {passing_case}")
        assert again.ret == pytest.ExitCode.OK and again.parseoutcomes().get("passed") == 1, again.stdout.str()


def test_reading_past_the_visible_keys_says_so_from_the_poison_value(pytester):
    """The last query of each request attends to the unwritten slot after its last key: its
    output is the finite poison, and the failure says what that means."""
    result = _run_suite(pytester, "broken_backends_more:ReadsPastSeqLen", "outputs and decode_only")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    out = _flat(result)
    assert "of the wrong values are 1000, the poison value of a request's unwritten and out-of-window slots: " \
           "the backend attended to keys outside the visible range" in out, out


def test_a_gqa_mapping_bug_names_the_wrong_and_the_right_heads(pytester):
    """Query head h reading KV head h % num_kv_heads instead of h // group: the message names
    the wrong heads, the right ones, and the KV head each wrong head read."""
    result = _run_suite(pytester, "broken_backends_more:ModuloHeads", "outputs and (mixed or mqa) and not fp16 "
                        "and not bf16")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    out = _flat(result)
    assert "wrong in query heads [1, 3, 4, 6], right in [0, 2, 5, 7]. A GQA head-mapping bug: query head 1 " \
           "matches KV head 1 (expected 0); query head 3 matches KV head 1 (expected 0); query head 4 matches " \
           "KV head 0 (expected 1)" in out, out
    assert "query head h must read KV head h // 4" in out
    outcomes = result.parseoutcomes()   # MQA (one KV head) has no mapping to get wrong
    assert outcomes.get("failed") == 1 and outcomes.get("passed", 0) >= 1, outcomes
    result.stdout.fnmatch_lines(["FAILED *test_outputs_match_reference?broken_backends_more:ModuloHeads-mixed]*"])


def test_a_write_into_a_copy_says_the_step_wrote_none_of_its_slots(pytester):
    result = _run_suite(pytester, "broken_backends_more:WritesIntoACopy", "decode_only")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["FAILED *test_kv_written_exactly_at_slot_mapping?broken_backends_more:"
                                 "WritesIntoACopy-decode_only]*"])
    out = _flat(result)
    assert "step 0, cache group 0: the step wrote none of its 55 slots" in out, out
    assert "reshape()" in out and "the step wrote none of its slots (see test_kv_written" in out, out


@pytest.mark.parametrize("backend", [
    "torch_native",
    "attnplug.backends.emulators:FlashAttn3EmulatedBackend",
    "attnplug.backends.emulators:FlashInferEmulatedBackend",
])
def test_correct_backends_pass_the_poisoned_window_cases(pytester, backend):
    result = _run_suite(pytester, backend, "window and (outputs or written)")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert result.parseoutcomes().get("passed", 0) >= 8


def test_the_plan_names_every_kind_of_poisoned_block():
    case = ConformanceCase(name="p", requests=((9, 1), (0, 3)), block_size=4, kernel_block_size=2,
                           sliding_window=3, spare_blocks=1, block_order="sequential")
    # manager blocks: r0 -> 1, 2, 3; r1 -> 4; spare 5; the null block 0
    blocks = ([[1, 2, 3], [4]], [[1, 2, 3], [4]])
    steps = schedule(case)   # [{0: 9}, {0: 1, 1: 3}]
    plan = PoisonPlan(case, blocks, 6, steps, 2)
    first = plan.nan_blocks(0, 0, [0, 0])
    assert sorted(first) == [0, 1, 8, 9, 10, 11]   # kernel blocks of manager blocks 0, 4 (not admitted), 5
    assert "the null block" in first[0] and "kernel block 1 of manager block 0" in first[1]
    assert "request r1's, which is not admitted before step 1" in first[8]
    assert "a spare block no request owns" in first[10]
    checked = plan.nan_blocks(1, 0, [9, 0])   # window 3 after 9 tokens starts at 7: manager block 1 is freed
    assert sorted(checked) == [0, 1, 2, 3, 10, 11]
    assert "request r0's block of positions 0..3, freed" in checked[2] and "starts at position 7" in checked[2]
    assert plan.admitted_at(1) == [1]
