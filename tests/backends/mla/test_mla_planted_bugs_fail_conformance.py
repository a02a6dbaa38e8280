"""Each of four planted MLA bugs fails the MLA conformance family, naming the case; the
torch_native_mla backend passes it (through ``attnplug check``)."""

from __future__ import annotations

import pytest

from attnplug.backends.mla.torch_native.backend import TorchNativeMLABackend
from attnplug.plugins.conformance import mla_checks
from attnplug.plugins.conformance.mla_cases import MLA_CASES
from attnplug.plugins.conformance.mla_harness import MLAStep

import buggy_mla

MIXED = next(c for c in MLA_CASES if c.name == "mixed")


def _case_problems(backend, case):
    step = MLAStep(backend, case, "cpu")
    run = step.run()
    return mla_checks.check_outputs(step, run) + mla_checks.check_cache(run)


def test_reference_backend_passes_every_check():
    for case in MLA_CASES:
        assert _case_problems(TorchNativeMLABackend, case) == [], case.name
    assert mla_checks.check_absorbed_equals_expanded(TorchNativeMLABackend, "cpu") == []
    assert mla_checks.check_chunked_equals_one_shot(TorchNativeMLABackend, "cpu") == []
    assert mla_checks.check_reentrant(TorchNativeMLABackend, "cpu") == []


def test_wrong_rope_half_fails_the_cache_check_naming_the_rope_part():
    problems = _case_problems(buggy_mla.WrongRopeHalf, MIXED)
    assert any("case 'mixed': latent rows of tokens" in p and "the k_pe (rope) part" in p for p in problems), problems


def test_missing_output_up_projection_fails_absorbed_vs_expanded():
    problems = mla_checks.check_absorbed_equals_expanded(buggy_mla.NoOutputUpProjection, "cpu")
    assert problems and all("case 'absorbed_vs_expanded': absorbed decode" in p for p in problems), problems


def test_chunk_lse_with_wrong_sign_fails_chunked_context():
    problems = mla_checks.check_chunked_equals_one_shot(buggy_mla.ChunkLseWrongSign, "cpu")
    assert any("case 'tiny_workspace': chunked-context prefill vs one-shot" in p for p in problems), problems


def test_null_block_read_fails_with_nan_poison():
    problems = _case_problems(buggy_mla.ReadsNullBlock, MLA_CASES[0])
    assert any("case 'decode_only'" in p and "NaN" in p and "null block" in p for p in problems), problems


def test_a_builder_that_stashes_per_step_state_fails_reentrancy():
    class Stateful(TorchNativeMLABackend.get_builder_cls()):
        """Keeps the last build's prefill in ``self`` and every metadata reads it from there (vllm#50945)."""

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            md = super().build(common_prefix_len, common_attn_metadata, fast_build)
            shared = self.__dict__.setdefault("shared", {})
            if md.prefill is not None:
                shared["prefill"] = md.prefill           # the last build wins for everyone
                return _Lazy(md, shared)
            return md

    backend = type("StatefulMLA", (TorchNativeMLABackend,), {"get_builder_cls": classmethod(lambda cls: Stateful)})
    problems = mla_checks.check_reentrant(backend, "cpu")
    assert any("the builder keeps per-step state" in p for p in problems), problems


class _Lazy:
    """Metadata whose ``prefill`` is read from the builder's shared dict at forward time."""

    def __init__(self, md, shared):
        self._md, self._shared = md, shared

    def __getattr__(self, name):
        return self._shared["prefill"] if name == "prefill" else getattr(self._md, name)


@pytest.mark.parametrize("bug, test_name", [
    ("WrongRopeHalf", "test_mla_latent_written_exactly_at_slot_mapping"),
    ("ReadsNullBlock", "test_mla_outputs_match_reference"),
])
def test_attnplug_check_reports_the_failing_case(bug, test_name, capsys):
    from attnplug.runner.commands.check import main

    rc = main([f"buggy_mla:{bug}", "--device", "cpu", "-k", "test_mla_"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert f"{test_name}[buggy_mla:{bug}-mixed]" in out and "case 'mixed'" in out, out
