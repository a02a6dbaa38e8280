"""Without processes: each rank's weight slices put back together are the full HF tensors
(KV heads replicated below tp), refused splits name the reason, and the compact
``SchedulerOutput`` encoding gives back exactly what the scheduler sent on a run with
chunked prefill, preemption and finished requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.runner.models import build_model, resolve_model_config
from attnplug.runner.parallel.encoding import KNOWN_FIELDS, EncodingError, decode, encode
from attnplug.runner.parallel.sharding import kv_head_range, shard_config, shard_state_dict
from attnplug.runner.parallel.pipeline import PipelineStageModel
from attnplug.runner.parallel.state import ParallelConfigError, ParallelState, check_sizes
from attnplug.runner.step.scheduler_output import SchedulerOutput

LLAMA = {"model_type": "llama", "vocab_size": 127, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "attention_bias": True}


def test_kv_heads_split_or_replicated():
    assert [kv_head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_reassemble_to_the_full_weights(tp):
    cfg = resolve_model_config(LLAMA)
    full = build_model(LLAMA, seed=3).state_dict()
    shards = [shard_state_dict(full, cfg, tp, r) for r in range(tp)]
    rank_cfg = shard_config(cfg, tp)
    assert (rank_cfg.num_attention_heads, rank_cfg.num_key_value_heads, rank_cfg.intermediate_size) == (4 // tp, 1, 96 // tp)
    for name, t in full.items():
        parts = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), t), name
        elif ".k_proj." in name or ".v_proj." in name:  # one KV head: every rank holds all of it
            assert all(torch.equal(p, t) for p in parts), name
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):  # 127 rows -> tp shards, zero padded
            cat = torch.cat(parts, 0)
            assert torch.equal(cat[:127], t) and not cat[127:].any(), name
        elif name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
            assert torch.equal(torch.cat(parts, 0), t), name
        else:  # norms and the row-parallel biases (added once after the all-reduce)
            assert all(torch.equal(p, t) for p in parts), name


def test_refused_splits_say_why():
    with pytest.raises(ParallelConfigError, match="num_attention_heads 4 is not a multiple of 3"):
        shard_config(resolve_model_config(LLAMA), 3)
    from attnplug.runner.models.presets import preset_config

    hybrid = preset_config("tiny-hybrid")  # 8 Mamba2 heads, one B/C group, mamba_expand 2
    assert shard_config(resolve_model_config(hybrid), 2).mamba_n_heads == 4
    with pytest.raises(ParallelConfigError, match="mamba_expand 2 is not a multiple of 4"):
        shard_config(resolve_model_config(hybrid), 4)
    with pytest.raises(ParallelConfigError, match="mamba_n_groups 2 is neither 1 nor a multiple of 4"):
        shard_config(resolve_model_config({**hybrid, "mamba_n_groups": 2, "mamba_expand": 4, "mamba_d_head": 128}), 4)
    with pytest.raises(ParallelConfigError, match="WORLD_SIZE is 3"):
        check_sizes(2, 1, 3)


def _recorded_outputs() -> list[SchedulerOutput]:
    from types import SimpleNamespace

    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.step.scheduler_output import SamplingParams

    model = build_model(LLAMA, block_size=4)
    model.attnplug_backends = {n: a.backend for n, a in model.attention_layers.items()}
    args = SimpleNamespace(model=None, backend=None, block_size=4, seed=0, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=16, num_blocks=None, force_preemption_every=3)
    setup = build_engine(args, model=model, requests=False)
    seen, run = [], setup.engine.runner.execute_model
    setup.engine.runner.execute_model = lambda out: (seen.append(out), run(out))[1]
    for i, n in enumerate((5, 30, 17, 2)):
        setup.engine.add_request(f"req-{i}", list(range(n)), SamplingParams(temperature=0.7, top_p=0.9, seed=i,
                                                                            max_tokens=4, stop_token_ids=(3,)))
    setup.engine.run()
    assert setup.engine.scheduler.num_preemptions > 0
    return seen


def test_compact_encoding_round_trips_real_steps():
    from attnplug.runner.step.kernels import kernels_available
    from attnplug.runner.step.packed_deltas import as_vllm_form

    outs = _recorded_outputs()
    assert any(any(o.scheduled_cached_reqs.resumed_from_preemption) for o in outs)
    assert any(o.finished_req_ids for o in outs) and any(None in o.scheduled_cached_reqs.new_block_ids for o in outs)
    # the scheduler packs its appends when the compiled kernels read them (SchedulerConfig.packed_deltas)
    assert any(o.packed_cached is not None for o in outs) == kernels_available()
    for out in outs:
        assert decode(encode(out)) == as_vllm_form(out)  # (sent in vLLM's form)
    # a field the encoding does not carry: fine at its default, refused when set
    bigger = dataclasses.make_dataclass("Out2", [("spec", int, 0)], bases=(SchedulerOutput,))
    KNOWN_FIELDS[bigger] = KNOWN_FIELDS[SchedulerOutput]
    try:
        o = as_vllm_form(outs[1])
        same = bigger(o.scheduled_new_reqs, o.scheduled_cached_reqs, o.num_scheduled_tokens,
                      o.total_num_scheduled_tokens, o.finished_req_ids)
        assert decode(encode(same)) == o
        with pytest.raises(EncodingError, match="Out2.spec is set"):
            encode(bigger(spec=1))
    finally:
        del KNOWN_FIELDS[bigger]


BAMBA = {"model_type": "bamba", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [1, 3], "mamba_n_heads": 4,
         "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8, "mamba_n_groups": 1}


def test_a_pipeline_stage_holds_its_layers_and_refuses_stages_of_other_cache_groups():
    stages = [PipelineStageModel(build_model(BAMBA, seed=0), ParallelState(rank=s, world_size=2, tp_rank=0, tp_size=1,
                                                                           pp_size=2, pp_rank=s, device="cpu"))
              for s in range(2)]
    for s, stage in enumerate(stages):  # a Mamba2 and an attention layer each, caches and configs of those only
        names = [f"model.layers.{2 * s}.mamba", f"model.layers.{2 * s + 1}.self_attn.attn"]
        assert stage.layer_names == list(stage.kv_cache_specs(4)) == list(stage.layer_configs(4)) == names
        assert list(stage.mamba_layers) == names[:1] and list(stage.attention_layers) == names[1:]
    state = ParallelState(rank=0, world_size=2, tp_rank=0, tp_size=1, pp_size=2, device="cpu")
    with pytest.raises(ParallelConfigError) as err:  # stage 1: two Mamba2 layers, no attention
        PipelineStageModel(build_model({**BAMBA, "attn_layer_indices": [1]}, seed=0), state)
    assert str(err.value) == ("--pipeline-parallel-size 2: the stages' layers form different cache groups "
                              "([['mamba', 'full_attention'], ['mamba']]); every stage needs the same groups")
