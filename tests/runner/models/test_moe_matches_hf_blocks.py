"""Our one ``MoEBlock`` against transformers' own MoE modules, same weights, float32: the
routers choose the same top-k experts for every token and the outputs agree to ~1e-6, for
Qwen3-MoE (softmax, renormalised), DeepSeek-V2 (grouped greedy, shared experts), DeepSeek-V3
(sigmoid, score-correction bias, group top-2, renormalised and scaled) and gpt-oss (biased
router, softmax over the top-k, clamped interleaved SwiGLU with biases)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnplug.runner.models.moe import MoEBlock, naive_moe_forward  # noqa: E402
from attnplug.runner.models.moe_config import parse_moe  # noqa: E402

H, TOKENS = 32, 96
CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock",
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True)),
    "deepseek_v2": ("DeepseekV2Config", "transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe",
                    dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2,
                         n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
    "deepseek_v3": ("DeepseekV3Config", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE",
                    dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, n_shared_experts=1,
                         n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "transformers.models.gpt_oss.modeling_gpt_oss", "GptOssMLP",
                dict(num_local_experts=8, num_experts_per_tok=4, intermediate_size=16, swiglu_limit=7.0)),
}


def _pair(name: str, seed: int = 0):
    """(HF block, our block loaded with its weights, the HF config dict)."""
    import importlib

    cfg_cls, module, block_cls, fields = CASES[name]
    hf_cfg = getattr(transformers, cfg_cls)(**{"hidden_size": H, "intermediate_size": 48, **fields})
    torch.manual_seed(seed)
    hf = getattr(importlib.import_module(module), block_cls)(hf_cfg).float().eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if "bias" not in pname else 0.5))
        for bname, b in hf.named_buffers():  # DeepSeek-V3's e_score_correction_bias: make it matter
            b.copy_(torch.rand(b.shape) * 0.5)
    ours = MoEBlock(parse_moe(hf_cfg.to_dict(), name), torch.float32, "cpu")
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours, hf_cfg


def _hf_route(hf, name: str, x: torch.Tensor) -> torch.Tensor:
    router = hf.router if name == "gpt_oss" else hf.gate
    return router(x)[2]


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_block_matches_hf(name):
    hf, ours, _ = _pair(name)
    x = torch.randn(TOKENS, H)
    with torch.no_grad():
        ref = hf(x.unsqueeze(0))
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        got = ours(x)
        hf_ids, (_, our_ids) = _hf_route(hf, name, x), ours.get_router()(x)
    assert torch.equal(hf_ids.sort(dim=-1).values, our_ids.sort(dim=-1).values), "top-k selections differ"
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    assert ref.abs().max() > 0.1  # the comparison is not between near-zero outputs


def test_moe_block_handles_one_token_and_unused_experts():
    hf, ours, _ = _pair("deepseek_v3", seed=3)
    x = torch.randn(1, H)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x.unsqueeze(0))[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(ours(x), naive_moe_forward(ours, x), atol=2e-6, rtol=1e-5)
        assert ours(x[:0]).shape == (0, H)


def test_noaux_tc_bias_changes_choice_not_weights():
    """The correction bias steers which experts are chosen, never their weights (DeepSeek-V3)."""
    _, ours, _ = _pair("deepseek_v3", seed=1)
    x = torch.randn(TOKENS, H)
    with torch.no_grad():
        w_biased, ids_biased = ours.get_router()(x)
        ours.get_router().e_score_correction_bias.zero_()
        w_plain, ids_plain = ours.get_router()(x)
    assert not torch.equal(ids_biased.sort(-1).values, ids_plain.sort(-1).values)
    scores = torch.sigmoid(x @ ours.get_router().weight.T).gather(1, ids_biased)
    torch.testing.assert_close(w_biased, scores / scores.sum(-1, keepdim=True) * 2.5)
