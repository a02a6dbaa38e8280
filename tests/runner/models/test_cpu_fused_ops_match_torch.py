"""The fused float32 CPU ops (``runner/models/cpu_ops.py``) compute what the torch ops they
replace compute, and the Llama-family forward uses them (or not: ``ATTNPLUG_CPU_FUSED_OPS=0``).

RoPE and the residual add are bit-identical to torch's kernels; RMSNorm's sum of squares is
accumulated in another order (a last-bit difference), SiLU's ``exp`` is libm's (1 ulp).
"""

from __future__ import annotations

import pytest
import torch

from attnplug.runner.models import cpu_ops
from attnplug.runner.models.rope import rotate

needs_module = pytest.mark.skipif(not cpu_ops.available(), reason="runner/models/_cpu_ops is not built")

EPS = 1e-6


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


def rows(n: int, d: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * scale


@needs_module
@pytest.mark.parametrize("d", [32, 100, 576])
def test_rms_norm_matches_torch_on_a_strided_input(d):
    wide = rows(9, d + 7, 0, 3.0)
    x, w = wide[:, 3:3 + d], rows(1, d, 1)[0]  # row stride d + 7
    got = cpu_ops.rms_norm(x, w, EPS)
    torch.testing.assert_close(got, torch_rms_norm(x, w, EPS), rtol=2e-6, atol=1e-6)
    assert got.is_contiguous()


@needs_module
def test_rms_norm_adds_eps_to_the_mean_square():
    x, w = rows(5, 64, 16, 1e-3), torch.ones(64)  # mean square ~1e-6: eps changes the result by ~2x
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)


@needs_module
@pytest.mark.parametrize("d", [64, 576])
def test_fused_add_rms_norm_writes_the_residual_sum_and_its_norm(d):
    x, res, w = rows(11, d, 2), rows(11, d, 3, 2.0), rows(1, d, 4)[0]
    want_res = res + x
    want_x = torch_rms_norm(want_res, w, 1e-5)
    cpu_ops.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(x, want_x, rtol=2e-6, atol=1e-6)


@needs_module
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_is_bit_identical_to_rotate_on_a_view_of_fused_qkv(interleaved, rotary_dim):
    n, heads, head_size = 7, 3, 64
    qkv = rows(n, (heads + 2) * head_size, 6)
    q = qkv[:, :heads * head_size].view(n, heads, head_size)  # row stride (heads + 2) * head_size
    angles = torch.arange(n).float()[:, None] * torch.rand(rotary_dim // 2, generator=torch.Generator().manual_seed(7))
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    r = rotary_dim
    want = torch.cat([rotate(q[..., :r], cos, sin, interleaved), q[..., r:]], dim=-1)
    assert torch.equal(cpu_ops.rope(q, cos, sin, rotary_dim, interleaved), want)


@needs_module
def test_results_do_not_depend_on_the_thread_split(monkeypatch):
    x, res, w = rows(37, 96, 8), rows(37, 96, 9), rows(1, 96, 10)[0]
    one = (cpu_ops.rms_norm(x, w, EPS),)
    x1, r1 = x.clone(), res.clone()
    cpu_ops.fused_add_rms_norm(x1, r1, w, EPS)
    monkeypatch.setattr(cpu_ops, "parallel_min_work_us", lambda: 0.0)  # every call splits
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = (cpu_ops.rms_norm(x, w, EPS),)
        x2, r2 = x.clone(), res.clone()
        cpu_ops.fused_add_rms_norm(x2, r2, w, EPS)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(x1, x2) and torch.equal(r1, r2)


@needs_module
def test_bad_inputs_are_refused_and_nothing_is_written():
    x, res, w = rows(4, 32, 12), rows(4, 32, 13), rows(1, 32, 14)[0]
    x0, res0 = x.clone(), res.clone()
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.fused_add_rms_norm(x, res.double(), w, EPS)
    with pytest.raises(ValueError, match="rows"):
        cpu_ops.fused_add_rms_norm(x, res[:3], w, EPS)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.fused_add_rms_norm(x, res, w[:16], EPS)
    with pytest.raises(ValueError, match="share storage"):
        cpu_ops.fused_add_rms_norm(x, x[:, :], w, EPS)
    with pytest.raises(ValueError, match="contiguous last"):
        cpu_ops.rms_norm(x.t(), w, EPS)
    with pytest.raises(ValueError, match="cos"):
        cpu_ops.rope(x.view(4, 2, 16), torch.ones(4, 1, 4), torch.ones(4, 1, 8), 16)
    assert torch.equal(x, x0) and torch.equal(res, res0)


def _forward(model, switch: str, monkeypatch) -> tuple[torch.Tensor, dict[str, int]]:
    from tests.runner.models.test_hf_forward_parity import run_schedule

    calls: dict[str, int] = {}
    for name in ("rms_norm", "fused_add_rms_norm", "rope", "rope_qk"):
        real = getattr(cpu_ops, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **k)
        monkeypatch.setattr(cpu_ops, name, counted)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, switch)
    tokens = [[5, 9, 2, 7, 1, 3, 8, 6], [4, 4, 6]]
    logits = run_schedule(model, tokens, [[(0, 7), (1, 3)], [(0, 1)]])
    monkeypatch.undo()
    return torch.cat(logits), calls


@needs_module
def test_the_llama_forward_uses_the_fused_ops_unless_switched_off(monkeypatch):
    from tests.runner.models.test_hf_forward_parity import hf_model, ours_from

    model = ours_from(hf_model("llama"))
    layers = model.config.num_hidden_layers
    fused, calls = _forward(model, "1", monkeypatch)
    steps, norms_per_step = 2, 2 * layers
    assert calls == {"rms_norm": steps, "fused_add_rms_norm": steps * norms_per_step,
                     "rope_qk": steps * layers}  # q and k from the fused output (test_qk_rope_from_the_fused_output.py)
    plain, calls_off = _forward(model, "0", monkeypatch)
    assert calls_off == {}
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-5)


@needs_module
def test_the_forward_takes_only_float32_cpu_tensors_without_autograd():
    x = torch.ones(2, 8)
    with torch.no_grad():
        assert cpu_ops.takes(x)
        assert not cpu_ops.takes(x.double()) and not cpu_ops.takes(x.t())
    with torch.enable_grad():
        assert not cpu_ops.takes(x)  # the ops write through raw pointers: no gradient


def test_fused_ops_are_built_wherever_the_step_kernels_are():
    """The extension is optional (pyproject.toml), so a compile error in ``_cpu_ops.pyx`` would
    only show as skipped tests; where the C compiler built the step compiler's module it must
    have built this one too."""
    from attnplug.runner.step.fast import NATIVE

    if NATIVE is None:
        pytest.skip("no compiled extension at all (no C compiler at install)")
    assert cpu_ops.available()
