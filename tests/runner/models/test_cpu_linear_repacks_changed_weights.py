"""CPU linears run through oneDNN with a prepacked weight (``runner/models/cpu_linear.py``):
the packed path is the one taken in inference, it equals ``F.linear``, and a weight written
in place (loading) or given new storage (``.to``) is packed again, never served stale."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from attnplug.runner.models import build_model, cpu_linear
from attnplug.runner.models.cpu_linear import Linear

pytestmark = pytest.mark.skipif(not cpu_linear.ENABLED, reason="torch built without oneDNN")

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_linear_equals_f_linear_and_is_cached(dtype, tol):
    lin = Linear(24, 40, bias=True, dtype=dtype)
    x = torch.randn(7, 24, dtype=dtype)
    with torch.no_grad():
        y = lin(x)
        (_, _, first), = lin.packed_weights.values()
        lin(x)
        (_, _, again), = lin.packed_weights.values()
    assert again is first  # packed once
    torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=tol, atol=tol)


def test_weights_written_in_place_or_moved_are_repacked():
    lin = Linear(16, 8, bias=False)
    x = torch.randn(3, 16)
    with torch.no_grad():
        lin(x)
        lin.weight.copy_(torch.randn(8, 16))  # what load_hf_state_dict does
        torch.testing.assert_close(lin(x), x @ lin.weight.T)
        lin.to(torch.float64).to(torch.float32)  # new storage, same version count possible
        lin.weight.mul_(3)
        torch.testing.assert_close(lin(x), x @ lin.weight.T)


def test_a_model_loaded_after_a_forward_uses_the_new_weights():
    """The fused q/k/v and gate/up buffers are written through their HF views: the version
    counter they share with the buffer must invalidate the packed copy."""
    a, b = build_model(LLAMA, seed=1), build_model(LLAMA, seed=2)
    x = torch.randn(5, 32)
    with torch.no_grad():
        attn, mlp = a.model.layers[0].self_attn, a.model.layers[0].mlp
        attn.project("qkv", x), mlp.project("gate_up", x), a.compute_logits(x)  # packs a's weights
        a.load_hf_state_dict(b.state_dict())
        for m, group in ((attn, "qkv"), (mlp, "gate_up")):
            got = torch.cat(m.project(group, x), dim=-1)
            torch.testing.assert_close(got, x @ m._buffers[f"{group}_weight"].T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.compute_logits(x), x @ b.lm_head.weight.T, rtol=1e-5, atol=1e-5)


def test_the_cache_is_never_copied_or_pickled():
    lin = Linear(4, 4)
    with torch.no_grad():
        lin(torch.randn(2, 4))
    assert len(lin.packed_weights) == 1
    assert len(copy.deepcopy(lin).packed_weights) == 0
    assert len(pickle.loads(pickle.dumps(lin)).packed_weights) == 0


def test_autograd_and_other_devices_fall_back_to_f_linear():
    lin = Linear(4, 4)
    y = lin(torch.randn(2, 4))  # grad mode, weight requires grad: plain F.linear, differentiable
    y.sum().backward()
    assert lin.weight.grad is not None and "packed_weights" not in lin.__dict__


def test_a_weight_made_under_inference_mode_runs_unpacked():
    """An inference tensor keeps no version counter (``_version`` raises), so a packed copy
    of it could not be invalidated: ``linear`` runs ``F.linear`` on it instead, and stays
    correct after the weight is rewritten in place (the failure seen: ``RuntimeError:
    Inference tensors do not track version counter`` from ``attnplug bench moe``)."""
    with torch.inference_mode():
        owner = torch.nn.Linear(8, 4, bias=False)
        x = torch.randn(3, 8)
        assert torch.allclose(cpu_linear.linear(x, owner.weight, None, owner), x @ owner.weight.T)
        owner.weight.mul_(2.0)
        assert torch.allclose(cpu_linear.linear(x, owner.weight, None, owner), x @ owner.weight.T)
