"""Fixtures of the KV connector tests: a redis-server of their own, and engines.

``redis_url`` starts Debian's ``redis-server`` on a free loopback port with a temporary
directory and no persistence, and stops it after the test (``make test`` installs the
package when missing; without it these tests fail, they do not skip).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.1}
GEMMA3 = {**LLAMA, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 3,
          "head_dim": 16, "sliding_window": 7,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "query_pre_attn_scalar": 24, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
BAMBA = {"model_type": "bamba", "architectures": ["BambaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_n_groups": 2,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8, "max_position_embeddings": 256,
         "initializer_range": 0.1, "rms_norm_eps": 1e-5}
MODELS = {"llama": LLAMA, "gemma3": GEMMA3, "bamba": BAMBA}
BLOCK = 4
# prompt lengths: several blocks each, two sharing a 12-token head
PROMPTS = [list(range(3, 33)), list(range(3, 15)) + [90, 91, 92, 93, 94, 95, 96, 97, 98],
           [7, 1, 2, 9] * 6 + [5], list(range(40, 57))]


class RedisServer:
    def __init__(self, tmp_path):
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (make test installs Debian's redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
                                      "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        self.client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                if self.client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        self.stop()
        pytest.fail("redis-server did not answer within 4 s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def build(cfg_name: str, url: str | None, *, prefix_caching: bool = False, budget: int = 16,
          preempt: int | None = None, num_blocks: int | None = None, **config):
    """An engine on a tiny random-weight model (seeded: the same weights every call)."""
    from attnplug.runner.commands.assemble import build_engine, resolve_backend
    from attnplug.runner.commands.model_loading import build_with_backends

    model = build_with_backends(MODELS[cfg_name], backend=None, block_size=BLOCK, resolve=resolve_backend, seed=3)
    conf = ",".join([f"url={url}", *(f"{k}={v}" for k, v in config.items())]) if url else None
    args = SimpleNamespace(model=f"test-{cfg_name}", backend=None, block_size=BLOCK, seed=3, max_model_len=96,
                           max_num_seqs=4, max_num_batched_tokens=budget, num_blocks=num_blocks, record_logits=False,
                           force_preemption_every=preempt, async_scheduling=False, speculative=None,
                           prefix_caching=prefix_caching, kv_connector="redis" if url else None,
                           kv_connector_config=conf)
    return build_engine(args, model=model, requests=False)


def run(setup, prompts=PROMPTS, max_tokens: int = 6):
    """Greedy outputs ``{req_id: tokens}``, the summary and the tokens the engine scheduled."""
    from attnplug.runner.step.scheduler_output import SamplingParams

    eng = setup.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r-{i}", p, SamplingParams(max_tokens=max_tokens))
    results = eng.run()
    summary = setup.summary(results, 1.0)
    for conn in (eng.scheduler.kv_connector, getattr(eng.runner, "kv_connector", None)):
        if conn is not None:
            conn.close()
    return {rid: r.output_token_ids for rid, r in sorted(results.items())}, summary


@pytest.fixture
def kv_engines():
    return SimpleNamespace(build=build, run=run, PROMPTS=PROMPTS)
