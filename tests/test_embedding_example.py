"""``docs/examples/embed_loop.py`` (the loop of ``docs/embedding.md``) produces the right tokens.

Its hand-built scheduler outputs (new and resident requests in one step, chunked prefills
whose logits are discarded, finished requests) must give, token for token, what a plain
greedy decode without any cache gives (the same tiny model, full causal attention
recomputed from scratch each token), and what attnplug's own ``LLMEngine`` (``Scheduler``
+ ``ModelRunner``) gives on the same requests. The doc quotes the example verbatim.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnplug.runner import LLMEngine, ModelRunner, RunnerConfig, SamplingParams, Scheduler, SchedulerConfig

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "examples" / "embed_loop.py"
MAX_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only contend with whatever else runs on the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("embed_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prompts(ex):
    rng = np.random.default_rng(3)
    return {f"r{i}": rng.integers(0, ex.VOCAB, n).tolist() for i, n in enumerate((13, 5, 9, 2, 11, 7))}


@torch.inference_mode()
def greedy_without_cache(ex, model, prompt: list[int], max_tokens: int) -> list[int]:
    """Recompute the whole sequence each token: plain causal SDPA, no paging, no backend."""
    toks = list(prompt)
    groups = ex.HEADS // ex.KV_HEADS
    for _ in range(max_tokens):
        n = len(toks)
        h = model.embed(torch.tensor(toks)) + model.pos(torch.arange(n))
        for qkv, proj in zip(model.qkv, model.proj):
            q, k, v = qkv(h).split([ex.HEADS * ex.HEAD_SIZE, ex.KV_HEADS * ex.HEAD_SIZE,
                                    ex.KV_HEADS * ex.HEAD_SIZE], dim=-1)
            q = q.reshape(n, ex.HEADS, ex.HEAD_SIZE).transpose(0, 1)
            k = k.reshape(n, ex.KV_HEADS, ex.HEAD_SIZE).repeat_interleave(groups, dim=1).transpose(0, 1)
            v = v.reshape(n, ex.KV_HEADS, ex.HEAD_SIZE).repeat_interleave(groups, dim=1).transpose(0, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + proj(out.transpose(0, 1).reshape(n, ex.HEADS * ex.HEAD_SIZE))
        toks.append(int(model.compute_logits(h[-1:]).argmax()))
    return toks[len(prompt):]


def engine_tokens(ex, prompts, budget: int) -> dict[str, list[int]]:
    backends = [ex.select_attention_backend()]
    model = ex.TinyModel(backends[0], seed=0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=ex.MAX_REQS,
                                      max_model_len=ex.MAX_LEN), ex.KV_CONFIG)
    runner = ModelRunner(model, ex.KV_CONFIG, backends, RunnerConfig(ex.MAX_REQS, ex.MAX_LEN, budget))
    engine = LLMEngine(sched, runner)
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {rid: r.output_token_ids for rid, r in engine.run().items()}


def recording_compiler(ex, seen: dict[str, int]):
    """``ex.StepCompiler`` counting the cases the loop is meant to exercise."""

    class Recording(ex.StepCompiler):
        def update_states(self, so):
            seen["new_and_cached"] += bool(so.scheduled_new_reqs and so.scheduled_cached_reqs.req_ids)
            seen["finished"] += len(so.finished_req_ids)
            super().update_states(so)

        def prepare_inputs(self, *args, **kwargs):
            inputs = super().prepare_inputs(*args, **kwargs)
            seen["discarded"] += int(inputs.discard.sum())
            return inputs

    return Recording


@pytest.mark.parametrize("budget", [8, 3])
def test_embed_loop_tokens_equal_a_cacheless_greedy_decode_and_the_engine(ex, prompts, budget, monkeypatch):
    seen = dict.fromkeys(("new_and_cached", "finished", "discarded"), 0)
    monkeypatch.setattr(ex, "StepCompiler", recording_compiler(ex, seen))
    got = ex.generate(prompts, MAX_TOKENS, budget=budget)
    assert seen["finished"] == len(prompts) and seen["new_and_cached"] and seen["discarded"], seen
    model = ex.TinyModel(ex.select_attention_backend(), seed=0)
    want = {rid: greedy_without_cache(ex, model, p, MAX_TOKENS) for rid, p in prompts.items()}
    assert got == want
    assert engine_tokens(ex, prompts, budget) == want
    assert len({tuple(t) for t in want.values()}) == len(want)  # the prompts lead to different tokens


def test_example_runs_as_a_script():
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.startswith("{'a': ["), out.stdout + out.stderr


def test_the_doc_quotes_the_example_verbatim_and_imports_only_public_modules():
    doc = (EXAMPLE.parents[1] / "embedding.md").read_text()
    text = EXAMPLE.read_text()
    assert f"```python\n{text}```" in doc, "docs/embedding.md must quote docs/examples/embed_loop.py in full"
    imports = [line for line in text.splitlines() if line.startswith(("from attnplug", "import attnplug"))]
    assert imports and all(line.split()[1] in ("attnplug", "attnplug.runner", "attnplug.plugins") for line in imports)
