"""gdn_fla's lowering to flash-linear-attention's entry points, against their CPU emulator:
same outputs and states as gdn_torch, prefill through chunk_gated_delta_rule with the step's
cu_seqlens, decodes through fused_recurrent_gated_delta_rule, contract violations named."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.emulators import FLA_EMULATOR, FlaContractError, GDNFlaEmulatedBackend
from attnplug.backends.state.gdn import GDNTorchBackend
from gdn_stepper import LCFG, Stepper, _part, _seq  # noqa: E402 (tests/backends/conftest.py registers it)


def test_lowering_equals_the_torch_backend_and_calls_each_entry_point_with_the_step_layout():
    runs = {}
    for backend in (GDNTorchBackend, GDNFlaEmulatedBackend):
        FLA_EMULATOR.calls.clear()
        s = Stepper()
        s.impl = backend.get_impl_cls()(LCFG)
        xa, xb = _seq(1, 12), _seq(2, 5)
        first, _ = s.step([(3, 0, _part(xa, 0, 7)), (5, 0, _part(xb, 0, 4))])
        second, _ = s.step([(5, 4, _part(xb, 4, 5)), (3, 7, _part(xa, 7, 12))], pad=1)   # a decode, a prefill
        runs[backend.get_name()] = (first, second, [t.clone() for t in s.state], list(FLA_EMULATOR.calls))
    want, got = runs["gdn_torch"], runs["gdn_fla_emulated"]
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[3] == [("chunk_gated_delta_rule", [0, 7, 11]), ("fused_recurrent_gated_delta_rule", [0, 1]),
                      ("chunk_gated_delta_rule", [0, 5])]


@pytest.mark.parametrize("change,message", [
    (dict(cu_seqlens=torch.tensor([0, 3], dtype=torch.int32)), "cu_seqlens must be 1-D int64"),
    (dict(cu_seqlens=torch.tensor([0, 2])), r"cu_seqlens \[0, 2\] must run from 0 to T=3"),
    (dict(initial_state=torch.zeros(2, 2, 4, 3)), r"initial_state must be \[N, HV, K, V\] = \(1, 2, 4, 3\)"),
])
def test_the_emulator_names_the_argument_the_kernel_would_misread(change, message):
    args = dict(q=torch.randn(1, 3, 1, 4), k=torch.randn(1, 3, 1, 4), v=torch.randn(1, 3, 2, 3),
                g=-torch.rand(1, 3, 2), beta=torch.rand(1, 3, 2), initial_state=torch.zeros(1, 2, 4, 3),
                output_final_state=True, cu_seqlens=torch.tensor([0, 3]))
    args.update(change)
    with pytest.raises(FlaContractError, match=message):
        FLA_EMULATOR.chunk_gated_delta_rule(**args)
