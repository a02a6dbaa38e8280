"""ALiBi on the Triton kernel (interpreter, fp32): the ``alibi_*`` conformance cases (a
GQA batch with padding; a sliding window with chunked prefill) against torch_native, and
split-KV (the bias in every segment). A kernel that flips the bias's sign fails them
(planted once in the kernel by hand: both cases' outputs differ)."""

from __future__ import annotations

import pytest

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.backends.triton import TritonBackend
from attnplug.plugins.conformance import checks
from attnplug.plugins.conformance.cases import CASES
from attnplug.plugins.conformance.harness import run_case


@pytest.mark.parametrize("case", ["alibi_gqa", "alibi_sliding_chunked"])
def test_triton_alibi_matches_torch_native(case):
    c = next(x for x in CASES if x.name == case)
    run = run_case(TritonBackend, c, "cpu", c.block_size)
    assert run.error is None, run.error
    reference = run_case(TorchNativeBackend, c, "cpu", c.block_size)
    assert checks.check_outputs(run, reference, name_blocks=False) == []
    assert checks.check_outputs(run, None, name_blocks=False) == []  # and the dense oracle's bias


def test_split_kv_applies_alibi_in_every_segment():
    import torch

    from attnplug.backends.triton.attention import paged_attention
    from attnplug.plugins.conformance.oracle import alibi_slopes

    g = torch.Generator().manual_seed(0)
    H, HKV, D, B = 4, 2, 16, 16
    seq = [40, 23]
    table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    kc, vc = (torch.randn(6, B, HKV, D, generator=g) for _ in range(2))
    q = torch.randn(2, H, D, generator=g)
    qsl, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor(seq, dtype=torch.int32)
    slopes = alibi_slopes(type("C", (), {"alibi": True, "num_heads": H})())
    outs = [paged_attention(q, kc, vc, torch.zeros_like(q), qsl, lens, table, num_reqs=2, max_query_len=1,
                            scale=D ** -0.5, num_kv_splits=n, alibi_slopes=slopes) for n in (1, 4)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    plain = paged_attention(q, kc, vc, torch.zeros_like(q), qsl, lens, table, num_reqs=2, max_query_len=1,
                            scale=D ** -0.5)
    assert (outs[0] - plain).abs().max() > 1e-2  # the bias matters
