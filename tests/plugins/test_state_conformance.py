"""The state-backend conformance suite: mamba2_torch and the GDN backends pass it, and a Mamba2
or GDN backend with one realistic bug fails it naming the case (docs/conformance.md)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from attnplug.plugins.conformance.state_cases import STATE_CASES, StateCase, load_state_cases
from attnplug.runner.commands.check import parse, preflight

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent


def _run_suite(pytester, backend: str, keyword: str, *extra: str):
    pytester.syspathinsert(HERE)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs", "attnplug.plugins.conformance",
                                        "--attnplug-backend", backend, "-k", keyword, *extra)


def test_mamba2_torch_passes_every_state_case(pytester):
    result = _run_suite(pytester, "mamba2_torch", "state_")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert result.parseoutcomes().get("passed") == 3 * len(STATE_CASES) + 1   # + the allocation check


def test_gdn_torch_passes_every_state_case(pytester):
    """The same catalog in GDN terms (``state_kinds.GDNKind``): spec, inputs and reference of
    the ``"gdn"`` kind, verifying rows included (``supports_draft_verification``)."""
    result = _run_suite(pytester, "gdn_torch", "state_")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert result.parseoutcomes().get("passed") == 3 * len(STATE_CASES) + 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gdn_triton", "attnplug.backends.emulators:GDNFlaEmulatedBackend"])
def test_the_other_gdn_backends_pass_every_state_case(pytester, monkeypatch, backend):
    """gdn_triton in the Triton interpreter (bfloat16 cases skip: declared), gdn_fla's lowering
    over the flash-linear-attention emulator."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    result = _run_suite(pytester, backend, "state_")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert result.parseoutcomes().get("failed") is None and result.parseoutcomes().get("passed", 0) >= 3 * 10


def test_attnplug_check_accepts_a_mamba_backend():
    assert preflight(parse(["mamba2_torch"])) is None   # was refused with exit 6 ("attention cases only")


@pytest.mark.parametrize("cls, keyword, test, case, needle", [
    ("StateNotZeroed", "state_fresh_slot", "test_state_outputs_match_recurrence", "state_fresh_slot",
     "got nan, expected"),
    ("StateForgotten", "state_prefill_chunks", "test_state_slots_hold_the_recurrence_state", "state_prefill_chunks",
     "request r0's SSM state in slot"),
    ("StateWritesPadSlot", "state_decode", "test_state_slots_hold_the_recurrence_state", "state_decode",
     "PAD_SLOT_ID = -1 used as an index"),
], ids=["fresh_slot_not_zeroed", "state_not_carried", "pad_slot_written"])
def test_a_broken_state_backend_fails_naming_the_case(pytester, cls, keyword, test, case, needle):
    result = _run_suite(pytester, f"broken_backends_more:{cls}", keyword)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines([f"FAILED *{test}?broken_backends_more:{cls}-{case}]*"])
    out = " ".join(result.stdout.str().split())
    assert f"state case {case!r} on backend" in out and needle in out, out


PLANTED = [  # (backend class, the case that must fail, its failing test, a phrase of the failure)
    ("RejectedDraftKept", "state_spec_partial_acceptance", "test_state_slots_hold_the_recurrence_state",
     "request r1's SSM state in slot"),
    ("ConvNotCarried", "state_chunk_offsets", "test_state_slots_hold_the_recurrence_state",
     "request r0's conv state in slot"),
    ("HitNotInitial", "state_prefix_hit", "test_state_outputs_match_recurrence", "request r2 position 6"),
    ("PadRowWritesSlot0", "state_spec_partial_acceptance", "test_state_slots_hold_the_recurrence_state",
     "conv state of slot(s) [0] changed"),
]


PLANTED_GDN = [(f"GDN{cls}", case, test, needle.replace("SSM state", "recurrent state"))
               for cls, case, test, needle in PLANTED]


@pytest.mark.parametrize("planted", [PLANTED, PLANTED_GDN], ids=["mamba2", "gdn"])
def test_the_hybrid_state_family_fails_each_planted_bug_naming_the_case(pytester, planted):
    """One bug of each kind the field reported on hybrid models (tests/plugins/broken_state_backends.py:
    a rejected draft's state kept, the conv state not carried across a chunk boundary,
    ``has_initial_state`` wrong for a prefix hit, a padded row writing slot 0), in one session,
    in mamba2_torch and in gdn_torch."""
    PLANTED = planted
    backends = [a for cls, *_ in PLANTED for a in ("--attnplug-backend", f"broken_state_backends:{cls}")]
    keyword = " or ".join(sorted({case for _, case, _, _ in PLANTED}))
    result = _run_suite(pytester, backends[1], keyword, *backends[2:])
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    out = " ".join(result.stdout.str().split())
    for cls, case, test, needle in PLANTED:
        result.stdout.fnmatch_lines([f"FAILED *{test}?broken_state_backends:{cls}-{case}]*"])
        name = getattr(importlib.import_module("broken_state_backends"), cls).get_name()
        section = out.split(f"state case {case!r} on backend {name!r}")
        assert any(needle in part[:3000] for part in section[1:]), (cls, needle, out)


def test_state_cases_from_a_cases_file(pytester, tmp_path):
    case = StateCase(name="my_state_case", steps=(((0, 3), (1, 2)), ((0, 1), (1, 1))), num_heads=2, n_groups=1)
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([case.to_dict(), {"name": "attn", "requests": [[3, 1]]}]))
    assert load_state_cases(str(path)) == [case]
    result = _run_suite(pytester, "mamba2_torch", "my_state_case", "--attnplug-cases", str(path))
    assert result.ret == pytest.ExitCode.OK and result.parseoutcomes().get("passed") == 3, result.stdout.str()
    with pytest.raises(ValueError, match="unknown keys"):
        StateCase.from_dict({**case.to_dict(), "bogus": 1})
