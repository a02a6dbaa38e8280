"""The suite's building blocks: case catalog and JSON, capability assessment, scheduling,
the cheap pytest plugin, extra cases from a file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnplug.plugins.conformance.cases import CASES, ConformanceCase, load_cases
from attnplug.plugins.conformance.harness import schedule
from attnplug.plugins.conformance.requirements import assess

pytest_plugins = ["pytester"]


def test_catalog_is_unique_tiny_and_json_round_trips():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    for case in CASES:
        assert ConformanceCase.from_dict(json.loads(json.dumps(case.to_dict()))) == case
        assert sum(c + s for c, s in case.requests) <= 160, f"{case.name} is not tiny"


def test_catalog_covers_the_required_ground():
    tags = {t for c in CASES for t in c.tags}
    assert {"prefill", "decode", "mixed", "chunked", "gqa", "mqa", "kernel_block", "window", "softcap"} <= tags
    assert len({c.head_size for c in CASES}) >= 3
    assert {c.dtype for c in CASES} == {"float32", "float16", "bfloat16"}
    windows = [c for c in CASES if c.sliding_window]
    assert any(c.sliding_window % c.block_size for c in windows), "W not a multiple of the block size"
    assert any(c.sliding_window > max(a + b for a, b in c.requests) for c in windows), "W longer than every sequence"
    assert any(c.kernel_block_size and c.kernel_block_size != c.block_size for c in CASES)
    assert any(c.num_pad_tokens for c in CASES) and any(c.check_determinism for c in CASES)
    assert {c.block_order for c in CASES} == {"permuted", "sequential"}
    assert any(c.num_kv_heads == 1 < c.num_heads for c in CASES)
    assert any(all(s == 1 and n > 0 for n, s in c.requests) for c in CASES), "a decode-only batch"
    assert any(all(n == 0 for n, _ in c.requests) for c in CASES), "a prefill-only batch"
    scales = {c.softmax_scale for c in CASES if c.scale is not None}
    assert len(scales) >= 3 and any(c.scale and c.logits_soft_cap for c in CASES), "softmax scales"
    # a decode whose window spans cdiv(W - 1, B) + 1 > cdiv(W, B) (kernel) blocks
    assert any(c.sliding_window and n > 0 and s == 1
               and (n // (k := c.kernel_block_size or c.block_size)) - (max(0, n - c.sliding_window + 1) // k) + 1
               > -(-c.sliding_window // k) for c in windows for n, s in c.requests), "a straddling window"


def test_scale_is_a_case_field_that_json_and_property_mode_set():
    case = ConformanceCase.from_dict({"name": "g", "requests": [[3, 1]], "head_size": 64, "scale": 0.0625})
    assert case.softmax_scale == 0.0625 and case.to_dict()["scale"] == 0.0625
    assert ConformanceCase(name="d", requests=((3, 1),), head_size=64).softmax_scale == 0.125
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings

    from attnplug.backends.torch_native import TorchNativeBackend
    from attnplug.plugins.conformance.property import case_strategy

    drawn = set()

    @settings(max_examples=25, database=None, deadline=None, derandomize=True,  # (one fixed draw: never flaky)
              suppress_health_check=list(HealthCheck))
    @given(case_strategy(TorchNativeBackend))
    def collect(c):
        drawn.add(c.scale)

    collect()
    assert None in drawn and len(drawn) >= 3, drawn


@pytest.mark.parametrize("bad, needle", [
    ({"name": "x", "requests": [[0, 0]]}, "num_scheduled_tokens >= 1"),
    ({"name": "x", "requests": [[0, 2]], "num_heads": 3, "num_kv_heads": 2}, "not a multiple"),
    ({"name": "x", "requests": [[0, 2]], "dtype": "int8"}, "dtype"),
    ({"name": "x", "requests": [[0, 2]], "block_size": 16, "kernel_block_size": 5}, "does not divide"),
    ({"name": "x", "requests": [[0, 2]], "colour": "red"}, "unknown keys ['colour']"),
    ({"name": "x", "requests": [[0, 2]], "scale": 0}, "scale must be a finite number > 0"),
    ({"name": "x", "requests": [[0, 2]], "scale": "0.1"}, "scale must be a finite number > 0"),
    ({"name": "x", "requests": [[0, 2]], "scale": True}, "scale must be a finite number > 0"),
])
def test_invalid_cases_are_rejected(bad, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        ConformanceCase.from_dict(bad)


def test_schedule_chunks_history_then_runs_the_checked_step():
    case = ConformanceCase(name="s", requests=((12, 7), (3, 1), (0, 4)), history_chunk=5)
    assert schedule(case) == [{0: 5, 1: 3}, {0: 5}, {0: 2}, {0: 7, 1: 1, 2: 4}]


def _case(**kw) -> ConformanceCase:
    return ConformanceCase(name="probe", requests=((4, 1),), **kw)


def test_assess_skips_only_for_declared_limitations(make_backend):
    no_window = make_backend("nw", supports_sliding_window=False)
    a = assess(no_window, _case(sliding_window=3), "cpu")
    assert a.skip_reasons and "features()['sliding_window'] = False" in a.skip_reasons[0]
    assert assess(no_window, _case(), "cpu").skip_reasons == ()
    fp32_only = make_backend("f32", supported_dtypes=(__import__("torch").float32,))
    assert "dtype float16" in assess(fp32_only, _case(dtype="float16"), "cpu").skip_reasons[0]
    kb = make_backend("kb", supported_kernel_block_sizes=(32,))
    assert "kernel block size 16" in assess(kb, _case(block_size=64, kernel_block_size=16), "cpu").skip_reasons[0]
    assert assess(kb, _case(block_size=64), "cpu").kernel_block_size == 32
    gone = make_backend("gone", is_available=(False, "needs libfoo"))
    assert "needs libfoo" in assess(gone, _case(), "cpu").skip_reasons[0]
    mamba = make_backend("m", kv_cache_kind="mamba")
    assert "'mamba' caches" in assess(mamba, _case(), "cpu").skip_reasons[0]


def test_assess_fails_when_claims_and_validation_disagree(make_backend):
    def refuse_windows(cls, layer):
        return ["windows are not really supported"] if layer.sliding_window else []
    liar = make_backend("liar", validate_configuration=classmethod(refuse_windows))
    a = assess(liar, _case(sliding_window=3), "cpu")
    assert not a.skip_reasons and "windows are not really supported" in a.claim_mismatch
    assert "case 'probe'" in a.claim_mismatch


def test_pytest_plugin_import_is_cheap():
    code = ("import sys; import attnplug.plugins.conformance.pytest_plugin, attnplug, attnplug.plugins; "
            "heavy = [m for m in ('torch', 'numpy', 'attnplug.core') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_extra_cases_from_a_json_file(pytester, tmp_path):
    extra = ConformanceCase(name="my_extra_case", requests=((3, 1), (0, 5)), num_heads=2, num_kv_heads=1,
                            head_size=16, block_size=2)
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([extra.to_dict()]))
    assert load_cases(str(path)) == [extra]
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                          "--attnplug-backend", "torch_native", "--attnplug-cases", str(path),
                                          "-k", "my_extra_case", "-v")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["*test_outputs_match_reference?torch_native-my_extra_case? PASSED*"])
