"""gdn_triton in the Triton interpreter (fp32, tiny): the fused recurrent kernel == the torch
rule over packed sequences with initial states, and the backend's impl == gdn_torch's."""

from __future__ import annotations

import numpy as np
import torch

from attnplug.backends.state.gdn import GDNTorchBackend, GDNTritonBackend, ops
from attnplug.backends.state.gdn.triton_ops import fused_recurrent_gated_delta_rule
from attnplug.core.gdn import GDNLayerConfig
from gdn_stepper import LCFG, Stepper, _part, _seq  # noqa: E402 (tests/backends/conftest.py registers it)


def test_fused_recurrent_kernel_matches_the_torch_rule_per_sequence():
    H, DK, DV, lengths = 2, 4, 3, [3, 1, 0, 2]       # DK, DV below the block size: masked lanes
    gen = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q = ops.l2norm(torch.randn(T, H, DK, generator=gen)) * DK ** -0.5
    k = ops.l2norm(torch.randn(T, H, DK, generator=gen))
    v, g = torch.randn(T, H, DV, generator=gen), -torch.rand(T, H, generator=gen)
    beta, s0 = torch.rand(T, H, generator=gen), torch.randn(4, H, DK, DV, generator=gen)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    o, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta, s0, cu)
    for i in range(4):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        o_ref, f_ref = ops.recurrent_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s0[i])
        torch.testing.assert_close(o[sl], o_ref, atol=1e-5, rtol=1e-5, msg=f"sequence {i} output")
        torch.testing.assert_close(final[i], f_ref, atol=1e-5, rtol=1e-5, msg=f"sequence {i} final state")


def test_triton_impl_equals_the_torch_impl_on_a_mixed_step():
    assert GDNTritonBackend.validate_configuration(LCFG) == []
    assert GDNTritonBackend.validate_configuration(GDNLayerConfig(1, 2, 4, 3, 4, dtype=torch.bfloat16)) != []
    runs = {}
    for backend in (GDNTorchBackend, GDNTritonBackend):
        s = Stepper()
        s.impl = backend.get_impl_cls()(LCFG)
        xa, xb = _seq(1, 5), _seq(2, 3)
        first, _ = s.step([(3, 0, _part(xa, 0, 3)), (5, 0, _part(xb, 0, 2))])
        second, _ = s.step([(5, 2, _part(xb, 2, 3)), (3, 3, _part(xa, 3, 5))])   # a decode, then a prefill
        runs[backend.get_name()] = (first, second, [t.clone() for t in s.state])
    for got, want in zip(runs["gdn_triton"][:2], runs["gdn_torch"][:2]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(runs["gdn_triton"][2], runs["gdn_torch"][2]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
