"""Prompt embeddings through ``LLMEngine.add_request(prompt_embeds=)``: a request given the
model's own embedding of its prompt (and only zeros as prompt ids, so nothing can leak
through ``input_ids``) produces exactly the tokens of the same request given as tokens —
in a batch mixed with text requests, under chunked prefill (16-token steps, prompts up to
37), forced preemption (the recompute reads the kept embeddings again) and prefix caching
(two embedding requests with the same zero ids never share blocks). fp32, greedy,
torch_native. Embeddings the runner would refuse are refused at ``add_request``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.core.errors import InvalidRequestError
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


def make_engine(model, preempt_every: int | None, prefix_caching: bool = False):
    groups = group_layers_by_spec(model.kv_cache_specs(BLOCK))
    kv = KVCacheConfig(120, groups)
    runner = ModelRunner(model, kv, [TorchNativeBackend] * len(groups),
                         RunnerConfig(max_num_reqs=4, max_model_len=96, max_num_batched_tokens=STEP_TOKENS),
                         enable_prompt_embeds=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=STEP_TOKENS, max_num_seqs=4, max_model_len=96,
                                      force_preemption_every=preempt_every,
                                      enable_prefix_caching=prefix_caching), kv)
    return LLMEngine(sched, runner)


def run(model, prompts: dict[str, list[int]], embeds: dict[str, torch.Tensor], preempt_every: int | None,
        prefix_caching: bool = False):
    engine = make_engine(model, preempt_every, prefix_caching)
    runner, sched = engine.runner, engine.scheduler
    seen = {"embed_steps": 0}
    prepare = runner.compiler.prepare_inputs

    def counting_prepare(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        seen["embed_steps"] += inputs.inputs_embeds is not None
        return inputs

    runner.compiler.prepare_inputs = counting_prepare
    for rid, prompt in prompts.items():
        if rid in embeds:
            engine.add_request(rid, [0] * len(prompt), SamplingParams(max_tokens=6), prompt_embeds=embeds[rid])
        else:
            engine.add_request(rid, prompt, SamplingParams(max_tokens=6))
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
    # prefix caching: r1 and r3 as embeddings share their zero ids with r0/r2 but not one block
    got, _, _ = run(model, prompts, own, preempt_every=None, prefix_caching=True)
    assert got == want


def test_embeddings_the_runner_would_refuse_are_refused_at_add_request():
    model = build_model(LLAMA, block_size=BLOCK, seed=0)
    engine = make_engine(model, None)
    for bad in (torch.zeros(3, 31), torch.zeros(4, 32), torch.zeros(3, 32, dtype=torch.float16)):
        with pytest.raises(InvalidRequestError, match="prompt_embeds"):
            engine.add_request("a", [0, 0, 0], SamplingParams(), prompt_embeds=bad)
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()
