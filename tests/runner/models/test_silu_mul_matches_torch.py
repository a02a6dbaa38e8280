"""``silu_mul`` (runner/models/silu_mul.py) gives torch's ``silu(gate) * up`` bit for bit,
at one thread and at two where torch splits the rows alike; the MLP uses it only there."""

from __future__ import annotations

import pytest
import torch

from attnplug.runner.models import build_model, silu_mul

pytestmark = pytest.mark.skipif(not silu_mul.ready(), reason="no compiled silu_mul or torch's CPU capability is not AVX512")

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 88.7, -88.7, -104.0, 1e-30, -1e-30]


def _halves(n: int, d: int, scale: float, seed: int):
    gate_up = torch.randn(n, 2 * d, generator=torch.Generator().manual_seed(seed)) * scale
    gate_up[0, :len(SPECIALS)] = torch.tensor(SPECIALS)
    return gate_up[:, :d], gate_up[:, d:]  # the fused output's column halves: row stride 2d


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("n, d, scale", [(64, 512, 1.0), (16, 1536, 4.0), (7, 100, 30.0), (3, 33, 100.0), (40, 48, 20.0),
                                         (1, 16, 10.0), (300, 544, 8.0)])
def test_one_thread_matches_torch_bit_for_bit(n, d, scale):
    gate, up = _halves(n, d, scale, seed=d)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = torch.nn.functional.silu(gate) * up
        got = silu_mul.silu_mul(gate, up)
    finally:
        torch.set_num_threads(before)
    assert got.is_contiguous() and _same_bits(got, want)


@pytest.mark.parametrize("n, d", [(2048, 512), (96, 1536), (63, 544)])
def test_two_threads_match_torch_wherever_torch_splits_alike(n, d):
    gate, up = _halves(n, d, 3.0, seed=n)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = torch.nn.functional.silu(gate) * up
        alike = silu_mul.rounds_like_torch(n, d, 2)
        got = silu_mul.silu_mul(gate, up)
    finally:
        torch.set_num_threads(before)
    assert alike == ((n, d) != (63, 544))  # 34,272 elements: torch's second run starts 272 into row 31
    if alike:
        assert _same_bits(got, want)


def test_torch_split_rule():
    assert silu_mul.rounds_like_torch(64, 512, 2)  # 32,768 elements: one thread
    assert silu_mul.rounds_like_torch(4096, 100, 1)
    assert silu_mul.rounds_like_torch(4096, 100, 2)  # 409,600 / 2 = 2,048 rows exactly
    assert not silu_mul.rounds_like_torch(4095, 100, 2)  # 204,750 = 2,047 rows and 50 elements
    assert not silu_mul.rounds_like_torch(4096, 100, 3)  # 136,534 = 1,365 rows and 34


def test_bad_input_is_refused():
    gate, up = _halves(4, 32, 1.0, seed=1)
    for bad_gate, bad_up, match in [(gate.double(), up, "float32"), (gate, up[:, :16], "columns"),
                                    (gate, up[:3], "rows"), (gate.t(), up, "contiguous last")]:
        with pytest.raises(ValueError, match=match):
            silu_mul.silu_mul(bad_gate, bad_up)


def test_the_mlp_uses_it_and_gives_the_torch_bits(monkeypatch):
    from tests.runner.models.test_hf_forward_parity import SIZES

    model = build_model({**SIZES, "num_key_value_heads": 2, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                         "max_position_embeddings": 64, "rms_norm_eps": 1e-6})
    mlp = model.model.layers[0].mlp
    x = torch.randn(5, SIZES["hidden_size"], generator=torch.Generator().manual_seed(2))
    calls, checks = [], []
    real_pass, real_ready = silu_mul._pass, silu_mul.ready
    monkeypatch.setattr(silu_mul, "_pass", lambda g, u: calls.append(g.shape) or real_pass(g, u))
    monkeypatch.setattr(silu_mul, "ready", lambda: checks.append(1) or real_ready())
    with torch.no_grad():
        got = mlp(x)
        assert len(checks) == 1  # the conditions are tested once per call (takes), not again by silu_mul's checks
        monkeypatch.setenv("ATTNPLUG_CPU_FUSED_OPS", "0")
        want = mlp(x)
    assert calls == [torch.Size([5, SIZES["intermediate_size"]])]
    assert _same_bits(got, want)


def test_maybe_silu_mul_declines_what_takes_refuses():
    gate, up = _halves(4, 32, 1.0, seed=3)
    with torch.no_grad():
        for bad_gate, bad_up in [(gate.double(), up), (gate, up[:, :16]), (gate, up[:3]), (gate.t(), up.t())]:
            assert not silu_mul.takes(bad_gate, bad_up) and silu_mul.maybe_silu_mul(bad_gate, bad_up) is None
        got = silu_mul.maybe_silu_mul(gate, up)
    assert got is not None and _same_bits(got, silu_mul.silu_mul(gate, up))
