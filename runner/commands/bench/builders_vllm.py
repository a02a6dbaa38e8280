"""The triton builder beside vLLM's own, on the same step (run in a vLLM environment).

``python -m attnplug.runner.commands.bench.builders_vllm [--sizes 256,1024] [--steps 60]``
in ``.venv-vllm/0.33`` (``make .venv-vllm/0.33/.test``; ``VLLM_TARGET_DEVICE=cpu`` is set
here, as ``tests/vllm/conftest.py`` does). Per size ``N``: the steady-decode workload of
``attnplug bench step`` (``runner/commands/bench/workloads.py``) through the step
compiler; each step's group-0 ``CommonAttentionMetadata`` is lowered by attnplug's
``TritonMetadataBuilder`` and, wrapped field for field in vLLM's own
``CommonAttentionMetadata`` (the same tensors, no copy), by vLLM's
``TritonAttentionMetadataBuilder`` (made from a ``VllmConfig`` of a Llama-shaped model: 32
query heads, 8 KV heads, head size 128, bfloat16, block size 16). The two builds alternate
order every step, twice per step, in one process; median µs over the steps. vLLM's triton
builder has no ``update_block_table`` (it builds every group); attnplug's is timed too.
Prints one line per figure and the ratio ours / vLLM (``--json``: a JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_SIZE, BLOCK, MAX_MODEL_LEN = 32, 8, 128, 16, 8192


def _vllm_builder(num_reqs: int, max_num_batched_tokens: int):
    """vLLM's triton builder for a Llama-shaped layer (imports vLLM)."""
    import torch
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.plugins.vllm import _vllm as V

    d = Path(tempfile.mkdtemp(prefix="attnplug-builders-vllm-"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": HEADS * HEAD_SIZE, "head_dim": HEAD_SIZE, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "intermediate_size": 64, "vocab_size": 64,
        "max_position_embeddings": MAX_MODEL_LEN}))
    model = V.ModelConfig(model=str(d), dtype=torch.bfloat16, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN)
    config = V.VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK), scheduler_config=SchedulerConfig(
        max_num_seqs=num_reqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    return V, TritonAttentionMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))


def run(num_reqs: int, steps: int) -> dict[str, float]:
    """``{"ours build", "vllm build", "ours update_block_table": median µs, "ratio": ours / vLLM build}``."""
    import numpy as np

    from attnplug.core.contracts import BuilderConfig
    from attnplug.runner.commands.bench.builders import ATTN_SPEC, builder_class
    from attnplug.runner.commands.bench.workloads import steady_decode
    from attnplug.runner.step.compiler import StepCompiler

    w = steady_decode(num_reqs, steps, arrivals=False)
    cfg = dict(w.config)
    sc = StepCompiler(cfg.pop("block_sizes"), validate=False, reorder_batch_threshold=1, **cfg)
    V, theirs = _vllm_builder(num_reqs, w.config["max_num_batched_tokens"])
    bcfg = BuilderConfig(w.config["max_num_reqs"], w.config["max_num_batched_tokens"], w.config["max_model_len"])
    cls = builder_class("triton")
    ours, ours_g1 = cls(ATTN_SPEC, ["g0"], bcfg, "cpu"), cls(ATTN_SPEC, ["g1"], bcfg, "cpu")
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {"ours build": [], "vllm build": [], "ours update_block_table": []}
    for i, so in enumerate(w.steps[:w.num_warmup + steps]):
        sc.update_states(so)
        inputs = sc.prepare_inputs(so)
        cm, cm1 = inputs.common_attn_metadata[0], inputs.common_attn_metadata[1]
        vcm = V.VllmCommonAttentionMetadata(
            query_start_loc=cm.query_start_loc, query_start_loc_cpu=cm.query_start_loc_cpu, seq_lens=cm.seq_lens,
            num_reqs=cm.num_reqs, num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len, block_table_tensor=cm.block_table_tensor, slot_mapping=cm.slot_mapping,
            causal=True)
        for rep in range(2):
            for who in ((0, 1) if (i + rep) % 2 else (1, 0)):
                t0 = clock()
                md = ours.build(0, cm) if who == 0 else theirs.build(0, vcm)
                t1 = clock()
                if who == 0:
                    ours_g1.update_block_table(md, cm1.block_table_tensor, cm1.slot_mapping)
                t2 = clock()
                if i >= w.num_warmup:
                    times["ours build" if who == 0 else "vllm build"].append(t1 - t0)
                    if who == 0:
                        times["ours update_block_table"].append(t2 - t1)
        keep = np.flatnonzero(~inputs.discard)
        sc.append_output_tokens(keep, np.ones(keep.shape[0], dtype=np.int64))
    out = {k: statistics.median(v) / 1e3 for k, v in times.items()}
    out["ratio"] = out["ours build"] / out["vllm build"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnplug.runner.commands.bench.builders_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,1024", help="request counts N (comma-separated)")
    p.add_argument("--steps", type=int, default=60, help="timed steady-decode steps per size")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch

    torch.set_num_threads(1)
    rows = {int(n): run(int(n), args.steps) for n in args.sizes.split(",")}
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"triton builder, attnplug vs vLLM, median µs per call ({torch.get_num_threads()} torch thread)")
    for n, r in rows.items():
        print(f"N={n}: ours build {r['ours build']:.2f}, vLLM build {r['vllm build']:.2f}, ours / vLLM "
              f"{r['ratio']:.2f}; ours update_block_table {r['ours update_block_table']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
