"""Without processes: a Gated DeltaNet layer and a Qwen3-Next sparse MLP split over tp ranks
(``runner/parallel/gdn_sharding.py``) give, summed over the ranks, the whole layer's output:
each rank's layer (the family's own, built from ``shard_config``) runs its key and value heads,
its conv channels and its state only, and its ``out_proj`` / ``down_proj`` give partial sums.
Both projection layouts (Qwen3-Next's grouped ``in_proj_qkvz``, Qwen3.5's flat ``in_proj_qkv``),
two value heads per key head, over two steps (prefill then a continuation that reads the
conv and recurrent state the first step left). The rank's state is the full state's slice of
its heads and channels."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.state.gdn import GDNMetadataBuilder, GDNTorchBackend
from attnplug.core.contracts import BuilderConfig
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.models import resolve_model_config
from attnplug.runner.models.loader import build_model, construct_model
from attnplug.runner.models.qwen3_next import gdn_state_spec
from attnplug.runner.parallel.sharding import VOCAB, shard_config, shard_state_dict

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 4,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "initializer_range": 0.2, "rms_norm_eps": 1e-5}
QWEN3_NEXT = {**BASE, "model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "norm_topk_prob": True}
QWEN3_5 = {**BASE, "model_type": "qwen3_5_text"}
LAYER = "model.layers.0.linear_attn"
STEPS = ((0, 11), (11, 3))  # (computed, scheduled) of one request: a prefill, then a continuation


def _run_gdn(model, x: torch.Tensor):
    """Layer 0's GDN output for ``x`` over :data:`STEPS` (one request in state slot 1), and the final state."""
    layer = model.model.layers[0].linear_attn
    spec = gdn_state_spec(model.layer_configs(4)[LAYER], 4)
    state = GDNTorchBackend.allocate_state_cache(spec, 2, "cpu")
    builder = GDNMetadataBuilder(spec, [LAYER], BuilderConfig(2, 64, 128), "cpu")
    outs = []
    for computed, n in STEPS:
        md = builder.build(0, CommonAttentionMetadata.from_lengths([computed], [n], [[1]], block_size=1024))
        with torch.no_grad():
            outs.append(layer(x[computed:computed + n], state, md))
    return torch.cat(outs), state


def _rank_models(cfg: dict, tp: int):
    full_cfg = resolve_model_config(cfg)
    full = build_model(cfg, seed=0)
    ranks = []
    for rank in range(tp):
        part = construct_model(shard_config(full_cfg, tp), torch.float32, "cpu", 4)  # out_proj: partial sums
        shard = shard_state_dict(full.state_dict(), full_cfg, tp, rank)
        part.load_hf_state_dict({**shard, **{k: full.state_dict()[k] for k in VOCAB}})  # strict; vocabulary whole
        ranks.append(part)
    return full, ranks


@pytest.mark.parametrize("cfg", [QWEN3_NEXT, QWEN3_5], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("tp", [2, 4])
def test_gdn_rank_partial_sums_add_up_to_the_whole_layer(cfg, tp):
    full, ranks = _rank_models(cfg, tp)
    x = torch.randn(sum(n for _, n in STEPS), cfg["hidden_size"], generator=torch.Generator().manual_seed(1))
    want, full_state = _run_gdn(full, x)
    parts = [_run_gdn(part, x) for part in ranks]
    torch.testing.assert_close(sum(out for out, _ in parts), want, rtol=1e-5, atol=1e-5)
    K, V, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                     "linear_value_head_dim"))
    for rank, (_, state) in enumerate(parts):  # the rank's state: its value heads, its q | k | v channels
        vh = slice(rank * V // tp, (rank + 1) * V // tp)
        torch.testing.assert_close(state.recurrent_state[1], full_state.recurrent_state[1, vh])
        q, k, v = full_state.conv_state[1].split([K * dk, K * dk, V * dv])
        kc, vc = slice(rank * K * dk // tp, (rank + 1) * K * dk // tp), slice(rank * V * dv // tp, (rank + 1) * V * dv // tp)
        torch.testing.assert_close(state.conv_state[1], torch.cat([q[kc], k[kc], v[vc]]))


def test_sparse_mlp_with_gated_shared_expert_partial_sums_add_up():
    full, ranks = _rank_models(QWEN3_NEXT, 2)
    x = torch.randn(20, QWEN3_NEXT["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = full.model.layers[0].mlp(x)
        got = sum(part.model.layers[0].mlp(x) for part in ranks)
    assert ranks[0].model.layers[0].mlp.shared_expert.down_proj.in_features == QWEN3_NEXT["shared_expert_intermediate_size"] // 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
