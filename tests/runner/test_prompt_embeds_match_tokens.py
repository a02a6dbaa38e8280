"""Prompt embeddings: a request given the model's own embedding of its prompt (and only
zeros as prompt ids, so nothing can leak through ``input_ids``) produces exactly the tokens
of the same request given as tokens — alone, in a batch mixed with text requests, under
chunked prefill (16-token steps, prompts up to 37) and forced preemption (the recompute
reads the kept embeddings again). fp32, greedy, torch_native.
"""

from __future__ import annotations

import numpy as np
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.runner.execute.model_runner import ModelRunner, RunnerConfig
from attnplug.runner.models import build_model
from attnplug.runner.serve.engine import LLMEngine
from attnplug.runner.serve.scheduler import Scheduler, SchedulerConfig
from attnplug.runner.step.scheduler_output import SamplingParams

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.1}
BLOCK, STEP_TOKENS = 4, 16
PROMPT_LENS = (37, 9, 21, 5)


def run(model, prompts: dict[str, list[int]], embeds: dict[str, torch.Tensor], preempt_every: int):
    groups = group_layers_by_spec(model.kv_cache_specs(BLOCK))
    kv = KVCacheConfig(120, groups)
    runner = ModelRunner(model, kv, [TorchNativeBackend] * len(groups),
                         RunnerConfig(max_num_reqs=4, max_model_len=96, max_num_batched_tokens=STEP_TOKENS),
                         enable_prompt_embeds=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=STEP_TOKENS, max_num_seqs=4, max_model_len=96,
                                      force_preemption_every=preempt_every), kv)
    schedule = sched.schedule
    seen = {"embed_steps": 0}

    def schedule_with_embeds():  # the scheduler sends the embeddings with the request's first schedule
        so = schedule()
        for nr in so.scheduled_new_reqs:
            nr.prompt_embeds = embeds.get(nr.req_id)
        return so

    sched.schedule = schedule_with_embeds
    prepare = runner.compiler.prepare_inputs

    def counting_prepare(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        seen["embed_steps"] += inputs.inputs_embeds is not None
        return inputs

    runner.compiler.prepare_inputs = counting_prepare
    engine = LLMEngine(sched, runner)
    for rid, prompt in prompts.items():
        engine.add_request(rid, [0] * len(prompt) if rid in embeds else prompt, SamplingParams(max_tokens=6))
    results = engine.run()
    assert not runner.compiler.prompt_embeds.embeds, "finished requests' embeddings must be dropped"
    return {rid: r.output_token_ids for rid, r in results.items()}, sched.num_preemptions, seen["embed_steps"]


def test_own_embeddings_give_the_token_requests_tokens_mixed_chunked_and_preempted():
    torch.manual_seed(0)
    model = build_model(LLAMA, block_size=BLOCK, seed=0)
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(1, 96, n).tolist() for i, n in enumerate(PROMPT_LENS)}
    with torch.no_grad():
        own = {rid: model.model.embed_tokens(torch.tensor(p)).clone() for rid, p in prompts.items()}
    want, _, none = run(model, prompts, {}, preempt_every=None)
    assert none == 0  # text-only steps carry no inputs_embeds
    mixed = {rid: own[rid] for rid in ("r0", "r2")}
    got, preemptions, embed_steps = run(model, prompts, mixed, preempt_every=3)
    assert preemptions > 0 and embed_steps > 2
    assert got == want
