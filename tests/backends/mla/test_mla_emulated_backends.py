"""The flashmla and flashinfer_mla builders and impls over the CPU emulators of their
kernels: the MLA conformance family passes; the emulators refuse what the documents
forbid; a wrong lowering fails the family."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.backends.emulators import FlashInferMLAEmulatedBackend, FlashMLAEmulatedBackend, MLAContractError
from attnplug.backends.emulators.mla_backends import FlashInferMLAEmulatedBuilder
from attnplug.backends.emulators.mla_kernels import EmulatedBatchMLAPagedAttentionWrapper, FlashMLAEmulator
from attnplug.plugins.conformance import mla_checks
from attnplug.plugins.conformance.mla_cases import MLA_CASES
from attnplug.plugins.conformance.mla_harness import MLAStep


@pytest.mark.parametrize("backend, ran", [("attnplug.backends.emulators:FlashMLAEmulatedBackend", "6 passed"),
                                         ("attnplug.backends.emulators:FlashInferMLAEmulatedBackend", "22 passed")])
def test_attnplug_check_passes_on_the_emulated_mla_backends(backend, ran, capsys):
    from attnplug.runner.commands.check import main

    rc = main([backend, "--device", "cpu", "-k", "mla", "-v"])
    out = capsys.readouterr().out
    assert rc == 0 and ran in out, out


def test_flash_mla_emulator_refuses_a_stale_plan_and_other_page_sizes():
    emu = FlashMLAEmulator()
    seq = torch.tensor([5, 64], dtype=torch.int32)
    tile, splits = emu.get_mla_metadata(seq, 4, 1)
    q, cache = torch.randn(2, 1, 4, 48), torch.randn(4, 64, 1, 48)
    table = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)
    out, lse = emu.flash_mla_with_kvcache(q, cache, table, seq, 32, tile, splits, softmax_scale=0.2)
    assert out.shape == (2, 1, 4, 32) and lse.shape == (2, 4, 1)
    with pytest.raises(MLAContractError, match="planned for other cache_seqlens"):
        emu.flash_mla_with_kvcache(q, cache, table, seq + 1, 32, tile, splits)
    with pytest.raises(MLAContractError, match="page_block_size must be 64"):
        emu.flash_mla_with_kvcache(q, torch.randn(16, 16, 1, 48), table, seq, 32, tile, splits)
    with pytest.raises(MLAContractError, match="num_heads_k must be 1"):
        emu.get_mla_metadata(seq, 4, 2)


def test_flashinfer_mla_emulator_checks_the_plan_and_gives_base2_lse_by_default():
    w = EmulatedBatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.uint8))
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(MLAContractError, match="kv_len_arr"):
        w.plan(i32(0, 1), i32(0, 1), i32(3), i32(17), 2, 8, 4, 16, True, 0.5, torch.float32, torch.float32)
    w.plan(i32(0, 1), i32(0, 2), i32(3, 1), i32(17), 2, 8, 4, 16, True, 0.5, torch.float32, torch.float32)
    ckv, kpe = torch.randn(4, 16, 8), torch.randn(4, 16, 4)
    q_nope, q_pe = torch.randn(1, 2, 8), torch.randn(1, 2, 4)
    _, lse2 = w.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    _, lse_e = w.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
    torch.testing.assert_close(lse2 * torch.log(torch.tensor(2.0)), lse_e)
    with pytest.raises(MLAContractError, match="does not match the planned"):
        w.run(q_nope.half(), q_pe.half(), ckv.half(), kpe.half())


class _ShortKvLenBuilder(FlashInferMLAEmulatedBuilder):
    """Planted lowering bug: plans every decode with one key too few (its own token)."""

    def build_decode(self, cm, num_decodes):
        shorter = cm.replace(seq_lens=cm.seq_lens - 1, seq_lens_cpu=cm.seq_lens_cpu - 1)
        md = super().build_decode(shorter, num_decodes)
        return dataclasses.replace(md, seq_lens=cm.seq_lens[:num_decodes])


def test_a_wrong_kv_len_in_the_plan_fails_the_family():
    backend = type("ShortKvLen", (FlashInferMLAEmulatedBackend,),
                   {"get_builder_cls": classmethod(lambda cls: _ShortKvLenBuilder)})
    step = MLAStep(backend, MLA_CASES[0], "cpu")
    problems = mla_checks.check_outputs(step, step.run())
    assert any("case 'decode_only': output vs the expanded float64 reference" in p for p in problems), problems
