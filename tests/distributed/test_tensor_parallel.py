"""Tensor and pipeline parallel over real processes (gloo): TP = 2 and PP = 2 on 2, TP = 2 x
PP = 2 on 4 (one spawn per layout, every case in it). Greedy tokens identical to one process
and to HF transformers, for Llama GQA (KV heads split, and one KV head replicated on both
ranks), Gemma3 (sliding and global layers), DeepSeek-V3 (MLA heads split, the latent cache
replicated on every rank), Qwen3-MoE (experts split on their intermediate
dimension, router whole, q/k norms on each rank's heads), Bamba (Mamba2 heads, conv channels and B/C
groups split or replicated; stages of one Mamba2 and one attention layer) and Qwen3-Next (also PP=2, TP=2 x PP=2, slow) /
Qwen3.5 / Qwen3.5-MoE (Gated DeltaNet key and value heads, conv channels and state split;
gated q_proj rows per head; the gated shared expert split), under chunked
prefill and forced preemption, with the cross-rank metadata check on every step; every
rank's caches hold its stage's layers and its heads only. And the faults: a rank fed a
different step, a rank that raises, rank 0 failing between steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from attnplug.runner.commands.parity import _hf_greedy, _hf_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # dist_ranks: importable here and in the spawned ranks
import dist_ranks  # noqa: E402

from attnplug.runner.parallel.pipeline import stage_layers  # noqa: E402

BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "initializer_range": 0.1, "rope_theta": 10000.0}
LLAMA = {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
GEMMA3 = {**BASE, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4,
          "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 7,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
          "query_pre_attn_scalar": 24, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
CASES = {  # name: (config, forced preemption, broadcast method)
    "llama-kv2": ({**LLAMA, "num_key_value_heads": 2}, True, "fixed"),
    # one KV head for two ranks: replicated; a vocabulary that does not split evenly (padded shard)
    "llama-kv1": ({**LLAMA, "num_key_value_heads": 1, "vocab_size": 127}, False, "tensor"),
    "gemma3": (GEMMA3, True, "object"),
    # pipeline stages of 2 layers each need the same cache groups: sliding + global in each
    "gemma3-alt": ({**GEMMA3, "layer_types": ["sliding_attention", "full_attention"] * 2}, True, "fixed"),
}
BAMBA = {**BASE, "model_type": "bamba", "architectures": ["BambaForCausalLM"], "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 3, "num_key_value_heads": 2, "attn_layer_indices": [1],
         "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8,
         "rms_norm_eps": 1e-5}
CASES.update({
    # one B/C group: replicated on both ranks, and the gated norm's statistic all-reduced
    "bamba-g1": ({**BAMBA, "mamba_n_groups": 1}, True, "fixed"),
    "bamba-g2": ({**BAMBA, "mamba_n_groups": 2}, False, "fixed"),  # one group per rank
    # two stages of a Mamba2 and an attention layer each (the same cache groups per stage)
    "bamba-pp": ({**BAMBA, "mamba_n_groups": 1, "num_hidden_layers": 4, "attn_layer_indices": [1, 3]}, True,
                 "fixed"),
})
CASES["qwen3_moe"] = ({**BASE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_key_value_heads": 2,
                      "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "norm_topk_prob": True, "mlp_only_layers": [0]}, True, "fixed")  # dense layer 0, then experts
CASES["deepseek_v3"] = ({**BASE, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                         "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                         "qk_rope_head_dim": 16, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                         "n_group": 2, "topk_group": 1},
                        True, "fixed")  # MLA heads split, the latent cache replicated on both ranks
CASES["deepseek_v32"] = ({**CASES["deepseek_v3"][0], "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"],
                          "index_n_heads": 16, "index_head_dim": 32, "index_topk": 6},
                         True, "fixed")  # the indexer replicated (every rank selects the same tokens)
CASES["gpt_oss"] = ({**BASE, "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_key_value_heads": 2,
                    "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                    "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": False, "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 32}},
                   True, "fixed")  # each rank's heads with their own sinks; experts split over the ranks
QWEN3_NEXT_BASE = {**BASE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_key_value_heads": 2,
                   "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                   "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5}
# GDN key / value heads, conv channels and state split per rank (two value heads per key head: HF's
# grouped in_proj_qkvz), gated q_proj's query + gate rows per head, experts and the gated shared expert split
CASES["qwen3_next"] = ({**QWEN3_NEXT_BASE, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                       "shared_expert_intermediate_size": 16, "norm_topk_prob": True}, True, "fixed")
CASES["qwen3_5"] = ({**QWEN3_NEXT_BASE, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]},
                    True, "fixed")  # flat in_proj_qkv / z / b / a, dense MLP
CASES["qwen3_5_moe"] = ({**{k: v for k, v in CASES["qwen3_5"][0].items() if k != "intermediate_size"},
                         "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
                         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                         "shared_expert_intermediate_size": 16}, True, "fixed")  # Qwen3.5 + MoE on every layer
TP2 = ["bamba-g1", "gemma3", "llama-kv1", "llama-kv2", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next"]
PP2 = ["bamba-pp", "gemma3-alt", "llama-kv1", "llama-kv2"]
TP2xPP2 = ["bamba-pp", "gemma3-alt", "llama-kv1", "llama-kv2"]
# two stages of a GDN and a gated-attention layer each (the same cache groups per stage)
CASES["qwen3_next-pp"] = CASES["qwen3_next"]
CASES["qwen3_next-tp2xpp2"] = CASES["qwen3_next"]
SLOW = {"bamba-g2": (2, 1), "deepseek_v32": (2, 1), "qwen3_5": (2, 1), "qwen3_5_moe": (2, 1), "qwen3_next-pp": (2, 2),
        "qwen3_next-tp2xpp2": (4, 2)}
"""Cases run only with the slow tests: ``name: (world size, pipeline stages)``."""
MAX_TOKENS = 5


def _prompts(vocab: int, n: int = 5, seed: int = 1) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {f"req-{i}": rng.integers(0, vocab, size=int(k)).tolist() for i, k in enumerate(rng.integers(3, 41, n))}


def _run_cases(tmp, names, world: int, pp: int = 1):
    """Run the cases ``names`` once on ``world`` ranks (``pp`` stages); returns
    ``{name: (rank 0's json, [every rank's cache facts], hf, case)}``."""
    cases, refs = [], {}
    for name in names:
        cfg, preempt, method = CASES[name]
        _, hf = _hf_model(cfg, seed=1, dtype=torch.float32)
        path = tmp / f"{name}.pt"
        torch.save(hf.state_dict(), path)
        case = {"name": name, "cfg": cfg, "state_dict": str(path), "prompts": _prompts(cfg["vocab_size"]),
                "max_tokens": MAX_TOKENS, "preempt": preempt, "method": method}
        cases.append(case)
        refs[name] = (hf, case)
    codes, secs = dist_ranks.spawn(dist_ranks.tp_cases, world, cases, str(tmp), pp, env={"ATTNPLUG_VALIDATE": "1"},
                                   timeout=60 * world)
    assert codes == [0] * world, f"rank exit codes {codes} after {secs:.0f} s"
    return {name: (json.loads((tmp / f"{name}.json").read_text()),
                   [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(world)], *refs[name])
            for name in names}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _run_cases(tmp_path_factory.mktemp("tp2"), TP2, 2)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return _run_cases(tmp_path_factory.mktemp("pp2"), PP2, 2, pp=2)


@pytest.fixture(scope="module")
def tp2xpp2(tmp_path_factory):
    return _run_cases(tmp_path_factory.mktemp("tp2xpp2"), TP2xPP2, 4, pp=2)


@pytest.mark.parametrize("name", TP2)
def test_tp2_tokens_match_one_process_and_hf(tp2, name):
    _check(tp2[name], name, tp=2, pp=1)


@pytest.mark.parametrize("name", PP2)
def test_pp2_tokens_match_one_process_and_hf(pp2, name):
    _check(pp2[name], name, tp=1, pp=2)


@pytest.mark.parametrize("name", TP2xPP2)
def test_tp2_x_pp2_tokens_match_one_process_and_hf(tp2xpp2, name):
    _check(tp2xpp2[name], name, tp=2, pp=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_more_cases_match_one_process_and_hf(tmp_path, name):
    world, pp = SLOW[name]
    _check(_run_cases(tmp_path, [name], world, pp=pp)[name], name, tp=world // pp, pp=pp)


_REFS: dict[str, tuple] = {}


def _references(name: str, hf, case: dict):
    """One process's tokens and preemptions, and HF's greedy tokens, for a case (computed once;
    the HF weights come from a fixed seed, the same for every fixture)."""
    if name not in _REFS:
        model = dist_ranks.build_loaded(CASES[name][0], hf.state_dict(), 4)  # one process: the whole model
        tokens, setup = dist_ranks.run_engine(model, dist_ranks.engine_args(5, CASES[name][1]), case["prompts"],
                                              MAX_TOKENS)
        _REFS[name] = (tokens, setup.engine.scheduler.num_preemptions,
                       {rid: _hf_greedy(hf, p, MAX_TOKENS)[0] for rid, p in case["prompts"].items()})
    return _REFS[name]


def _expected_caches(cfg: dict, tp: int, pp: int, rank: int) -> dict:
    """The cache facts of global rank ``rank``: its stage's layers only, its heads only."""
    layers = stage_layers(cfg["num_hidden_layers"], pp)[rank // tp]
    n = cfg["num_hidden_layers"]
    gdn = "linear_num_value_heads" in cfg
    every = cfg.get("full_attention_interval", 1)
    attn = set(cfg.get("attn_layer_indices", [i for i in range(n) if (i + 1) % every == 0]))
    state = "linear_attn" if gdn else "mamba"
    names = [f"model.layers.{i}.self_attn.attn" if i in attn else f"model.layers.{i}.{state}" for i in layers]
    kv_heads = 1 if "kv_lora_rank" in cfg else max(1, cfg["num_key_value_heads"] // tp)  # MLA: one latent row
    per_layer = 2 if "index_topk" in cfg else 1  # DeepSeek-V3.2: + the indexer's key row (whole on every rank)
    names += [f"model.layers.{i}.self_attn.indexer" for i in layers if per_layer == 2]
    return {"layers": names, "kv_heads": [kv_heads] * per_layer * sum(i in attn for i in layers),
            "mamba_ssm_heads": [cfg.get("mamba_n_heads", 0) // tp] * sum(i not in attn for i in layers if not gdn),
            "gdn_state": [_gdn_rank_state(cfg, tp) for i in layers if gdn and i not in attn]}


def _gdn_rank_state(cfg: dict, tp: int) -> list[int]:
    """A GDN layer's value heads and conv channels (q, k: key heads; v: value heads) on one rank."""
    k, v = cfg["linear_num_key_heads"] // tp, cfg["linear_num_value_heads"] // tp
    return [v, 2 * k * cfg["linear_key_head_dim"] + v * cfg["linear_value_head_dim"]]


def _check(result, name: str, tp: int, pp: int) -> None:
    got, ranks, hf, case = result
    cfg, preempt, _ = CASES[name]
    tp1, preemptions, hf_tokens = _references(name, hf, case)
    assert got["tokens"] == tp1 == hf_tokens
    for rank, facts in enumerate(ranks):  # each rank's caches hold its heads, of its stage's layers, only
        want = _expected_caches(cfg, tp, pp, rank)
        assert {**facts, "layers": sorted(facts["layers"])} == {**want, "layers": sorted(want["layers"])}, rank
    assert got["checked_steps"] >= got["steps"] > 5, "the metadata identity check ran every step"
    if preempt:
        assert got["preemptions"] > 0 and preemptions > 0


def test_rank_fed_another_step_rank_0_failing_between_steps_and_raising_rank(tmp_path):
    cfg = {**LLAMA, "num_key_value_heads": 2}
    _, hf = _hf_model(cfg, seed=1, dtype=torch.float32)
    torch.save(hf.state_dict(), tmp_path / "w.pt")
    case = {"cfg": cfg, "state_dict": str(tmp_path / "w.pt"), "prompts": _prompts(128, n=3), "max_tokens": 4}
    # (the ranks talk over the default channel: the fixed-buffer broadcast)
    codes, secs = dist_ranks.spawn(dist_ranks.fault_cases, 2, case, str(tmp_path),
                                   env={"ATTNPLUG_VALIDATE": "1", "ATTNPLUG_DIST_TIMEOUT": "30"}, timeout=90)
    err0, err1 = ((tmp_path / f"rank{r}.err").read_text() for r in (0, 1))
    assert codes == [0, 0], f"exit codes {codes} after {secs:.0f} s; rank 0: {err0!r}; rank 1: {err1!r}"
    lines0, lines1 = err0.splitlines(), err1.splitlines()
    mismatch = "step 0: CommonAttentionMetadata differs from rank 0's on rank(s) [1] in field(s) ["
    for lines in (lines0, lines1):  # (1) both ranks stop on the step, naming it, the rank and the fields
        assert "RankMismatchError" in lines[0] and mismatch in lines[0] and "query_start_loc" in lines[0]
    # (2) rank 0's scheduler raises between steps: rank 1 stops at once (not at the 30 s timeout), with rank 0's line
    failed0 = "rank 0 of 2 failed: RuntimeError: planted scheduler fault before step 2"
    assert lines0[2] == "attnplug run: " + failed0
    assert lines1[2] == "attnplug run: rank 1 of 2 stopped: " + failed0
    stop0, stop1 = (float(lines[3].split(" at ")[1]) for lines in (lines0, lines1))
    assert lines0[3].startswith("status 1") and lines1[3].startswith("status 1") and stop1 - stop0 < 5
    # (3) rank 1 raises in a step: its line, and rank 0 ends too (its peer gone)
    assert "rank 1 of 2 failed: RuntimeError: planted fault in step 2" in lines1[4]
    assert "rank 0 of 2 failed:" in lines0[4] and "another rank failed" in lines0[4]
    assert secs < 60, f"the ranks took {secs:.0f} s to stop"
