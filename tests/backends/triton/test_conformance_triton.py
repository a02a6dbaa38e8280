"""The conformance suite on the triton backend (Triton interpreter, CPU, float32 and float16).

Three runs, in-process through pytester:

* the built-in catalog: everything passes; the only skips are the declared limitations
  (manager block sizes 1 and 4 are not multiples of a kernel block size, nor is a kernel
  block size of 4; bfloat16 under the interpreter) and the "undeclared feature" checks (triton declares every feature);
* ``cases_block16.json``: the catalog's window / soft-cap / chunked cases again at block
  sizes the kernels take (three by default; all, plus non-power-of-two GQA groups, head
  size 80 and 128-token manager blocks over 64-token kernel blocks, when ``slow``);
* ``slow``: ``split_backend:TritonSplitKVBackend``, the same builder and impl with a policy
  that always takes the split-KV path (segments + reduce), on decode and mixed cases (the
  kernel tests cover split-KV against the dense reference by default).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
EXPECTED_SKIP = re.compile(
    r"manager block size (1|4) is not a multiple of any declared kernel block size"
    r"|the case runs kernel block size 4 under manager block size 8; the backend declares kernel block sizes"
    r"|the case needs dtype bfloat16; the backend declares \['float16', 'float32'\]"
    r"|the backend declares '(sliding_window|logits_soft_cap|mqa_gqa|sinks|alibi)'; the cases test it"
    r"|the backend serves 'attention' caches"  # the Mamba state cases (plugins/conformance/state_*)
    r"|property mode is off")


def _suite(pytester, *args: str):
    pytester.syspathinsert(HERE)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs", "--pyargs", "attnplug.plugins.conformance",
                                        "--attnplug-device", "cpu", *args)


def _skip_reasons(result) -> list[str]:
    return [line for line in result.outlines if line.startswith("SKIPPED")]


def test_builtin_catalog_passes(pytester):
    result = _suite(pytester, "--attnplug-backend", "triton")
    out = result.outcomes if hasattr(result, "outcomes") else result.parseoutcomes()
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert out.get("passed", 0) >= 60 and not out.get("failed") and not out.get("errors")
    unexpected = [s for s in _skip_reasons(result) if not EXPECTED_SKIP.search(s)]
    assert not unexpected, "\n".join(unexpected)


DEFAULT_EXTRA = ("window_7_chunked_block_16 or softcap_window_block_16 or window_fp16_block_16 "
                 "or window_20_block_16_straddles or scale_softcap_window_block_16")


def test_window_and_softcap_cases_at_kernel_block_sizes(pytester):
    """The catalog's window cases run at block size 4, which the kernels do not page by:
    the same shapes at block 16 (window + chunked history, window + soft-cap, float16,
    decodes whose window straddles one block more than cdiv(W, B), a scale with soft-cap)."""
    result = _suite(pytester, "--attnplug-backend", "triton", "--attnplug-cases", str(HERE / "cases_block16.json"),
                    "-k", DEFAULT_EXTRA)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    out = result.parseoutcomes()
    assert out.get("passed", 0) >= 5 * 4 and not out.get("failed")


@pytest.mark.slow
def test_all_extra_cases(pytester):
    result = _suite(pytester, "--attnplug-backend", "triton", "--attnplug-cases", str(HERE / "cases_block16.json"),
                    "-k", "(block_16 or kernel_16 or kernel_64 or gqa_group_3 or head_size_80) and not ("
                    + DEFAULT_EXTRA + ")")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    out = result.parseoutcomes()
    assert out.get("passed", 0) >= 6 * 4 and not out.get("failed")


@pytest.mark.slow
def test_split_kv_path_passes_decode_and_mixed_cases(pytester):
    result = _suite(pytester, "--attnplug-backend", "split_backend:TritonSplitKVBackend",
                    "--attnplug-cases", str(HERE / "cases_block16.json"),
                    "-k", "decode_only or mixed or window_5_block_16")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    out = result.parseoutcomes()
    assert out.get("passed", 0) >= 15 and not out.get("failed")
