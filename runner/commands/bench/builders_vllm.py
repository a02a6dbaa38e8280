"""The triton and flash_attn builders beside vLLM's own, on the same steps (run in a vLLM environment).

``python -m attnplug.runner.commands.bench.builders_vllm [--backends triton,flash_attn]
[--sizes 256,1024] [--steps 60] [--before REV] [--cold] [--json]`` in ``.venv-vllm/0.33``
(``make .venv-vllm/0.33/.test``; ``VLLM_TARGET_DEVICE=cpu`` is set here, as
``tests/vllm/conftest.py`` does). Per backend and size ``N``: the steady-decode workload of
``attnplug bench step`` (``runner/commands/bench/workloads.py``) through the step
compiler; each step's group-0 ``CommonAttentionMetadata`` is lowered by attnplug's builder
and, wrapped field for field in vLLM's own ``CommonAttentionMetadata`` (the same tensors,
no copy), by vLLM's (made from a ``VllmConfig`` of a Llama-shaped model: 32 query heads, 8
KV heads, head size 128, bfloat16, block size 16); then each rebinds the metadata to
group 1's block table and slot mapping (``update_block_table``) where it has one.

* ``triton``: attnplug's ``TritonMetadataBuilder`` against vLLM's
  ``TritonAttentionMetadataBuilder`` (which has no ``update_block_table``: vLLM builds every
  group, so its per-group cost is its build).
* ``flash_attn``: attnplug's builder planning for FlashAttention 3 (``FlashAttn3EmulatedBuilder``,
  as ``attnplug bench step``; no live layer, so no ``get_scheduler_metadata`` call) against
  vLLM's ``FlashAttentionMetadataBuilder``, which imports and builds on a CPU-only vLLM:
  without FlashAttention (``get_flash_attn_version()`` is ``None`` there) its
  ``aot_schedule`` is off, so it makes no ``get_scheduler_metadata`` call either.

``--before REV``: also the builder module of commit ``REV`` of this checkout
(``git show REV:backends/<backend>/builder.py``, executed as a module beside the current
one: it must import against the current tree), the "before" of a change, in the same run.

The contenders take turns, twice per step, cycling through every order of them (each is
first, and follows each other one, equally often), in one process (``--cold``: each call
after an 8 MiB read that leaves the core's L1/L2 cold; without it a call finds what the
step compiler and the contender before it left in the caches); median µs
per call over the steps, 1 torch thread. Prints one line per backend and size and the
ratios to vLLM's build (``--json``: a JSON object).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import tempfile
import time
import types
from pathlib import Path

HEADS, KV_HEADS, HEAD_SIZE, BLOCK, MAX_MODEL_LEN = 32, 8, 128, 16, 8192
BACKENDS = ("triton", "flash_attn")
EVICT_BYTES = 8 << 20
"""``--cold``: read before every timed call, more than a core's L2 (2 MiB here), so that no
contender finds the caches warmed by the one before it or by the previous step."""
BUILDER_FILES = {"triton": "backends/triton/builder.py", "flash_attn": "backends/flash_attn/builder.py"}


def _vllm_builder(backend: str, num_reqs: int, max_num_batched_tokens: int):
    """``(the plugin's vLLM adapter, vLLM's builder for a Llama-shaped layer)`` (imports vLLM)."""
    import torch
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.plugins.vllm import _vllm as V

    if backend == "triton":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder as cls
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder as cls
    with tempfile.TemporaryDirectory(prefix="attnplug-builders-vllm-") as tmp:
        d = Path(tmp)  # vLLM reads the HF config at construction; nothing reads it later
        (d / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": HEADS * HEAD_SIZE, "head_dim": HEAD_SIZE, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "intermediate_size": 64, "vocab_size": 64,
            "max_position_embeddings": MAX_MODEL_LEN}))
        model = V.ModelConfig(model=str(d), dtype=torch.bfloat16, skip_tokenizer_init=True,
                              max_model_len=MAX_MODEL_LEN)
    config = V.VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK), scheduler_config=SchedulerConfig(
        max_num_seqs=num_reqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    builder = cls(spec, ["layer.0"], config, torch.device("cpu"))
    if backend == "flash_attn" and builder.aot_schedule:
        raise SystemExit("vLLM's flash-attn builder plans with FlashAttention 3 here (aot_schedule): not comparable")
    return V, builder


def _ours(backend: str) -> type:
    from attnplug.runner.commands.bench.builders import builder_class

    return builder_class(backend)


def _before(backend: str, rev: str) -> type:
    """The builder class of ``backends/<backend>/builder.py`` at commit ``rev``, as a module of its own."""
    import attnplug

    root = Path(attnplug.__file__).resolve().parent
    rel = BUILDER_FILES[backend]
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{rel}"], capture_output=True, text=True,
                         check=True).stdout
    mod = types.ModuleType(f"attnplug_before_{backend}_builder")
    exec(compile(src, f"{rev}:{rel}", "exec"), mod.__dict__)  # noqa: S102 -- this checkout's own history
    if backend == "triton":
        return mod.TritonMetadataBuilder
    from attnplug.backends.emulators.backends import FlashAttn3EmulatedBuilder as current

    ns = {k: current.__dict__[k] for k in ("emulator", "load_kernels", "kernels_version")}
    return type("FlashAttn3EmulatedBuilderBefore", (mod.FlashAttnMetadataBuilder,), ns)


def run(backend: str, num_reqs: int, steps: int, before: str | None = None, cold: bool = False) -> dict[str, float]:
    """Median µs per call: ``"<who> build"`` and ``"<who> update_block_table"`` for ``who`` in
    ours, vllm (flash_attn only for its update) and before (``before`` given), and the
    ratios ``"<who> / vllm build"``. ``cold``: each call after an 8 MiB read (``EVICT_BYTES``)."""
    import numpy as np

    from attnplug.core.contracts import BuilderConfig
    from attnplug.runner.commands.bench.builders import ATTN_SPEC
    from attnplug.runner.commands.bench.workloads import steady_decode
    from attnplug.runner.step.compiler import StepCompiler

    w = steady_decode(num_reqs, steps, arrivals=False)
    cfg = dict(w.config)
    sc = StepCompiler(cfg.pop("block_sizes"), validate=False, reorder_batch_threshold=1, **cfg)
    V, vllm0 = _vllm_builder(backend, num_reqs, w.config["max_num_batched_tokens"])
    vllm1 = vllm0 if backend == "flash_attn" else None  # (its update_block_table reads no state of its own)
    bcfg = BuilderConfig(w.config["max_num_reqs"], w.config["max_num_batched_tokens"], w.config["max_model_len"])
    classes = {"ours": _ours(backend)}
    if before:
        classes["before"] = _before(backend, before)
    contenders = [(who, cls(ATTN_SPEC, ["g0"], bcfg, "cpu"), cls(ATTN_SPEC, ["g1"], bcfg, "cpu"), False)
                  for who, cls in classes.items()] + [("vllm", vllm0, vllm1, True)]
    evict = np.ones(EVICT_BYTES // 8) if cold else None
    orders = list(itertools.permutations(contenders))  # each first, and after each other, equally often
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {}
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
            for who, b0, b1, theirs in orders[(2 * i + rep) % len(orders)]:
                if evict is not None:
                    evict.sum()  # the call starts with cold L1/L2
                t0 = clock()
                md = b0.build(0, vcm if theirs else cm)
                t1 = clock()
                if b1 is not None:
                    b1.update_block_table(md, cm1.block_table_tensor, cm1.slot_mapping)
                t2 = clock()
                if i >= w.num_warmup:
                    times.setdefault(f"{who} build", []).append(t1 - t0)
                    if b1 is not None:
                        times.setdefault(f"{who} update_block_table", []).append(t2 - t1)
        keep = np.flatnonzero(~inputs.discard)
        sc.append_output_tokens(keep, np.ones(keep.shape[0], dtype=np.int64))
    out = {k: statistics.median(v) / 1e3 for k, v in times.items()}
    for who in classes:
        out[f"{who} / vllm build"] = out[f"{who} build"] / out["vllm build"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnplug.runner.commands.bench.builders_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=",".join(BACKENDS), help="triton and/or flash_attn (comma-separated)")
    p.add_argument("--sizes", default="256,1024", help="request counts N (comma-separated)")
    p.add_argument("--steps", type=int, default=60, help="timed steady-decode steps per size")
    p.add_argument("--before", metavar="REV", help="also time the builder module of commit REV (module docstring)")
    p.add_argument("--cold", action="store_true", help="evict L1/L2 before every timed call (EVICT_BYTES)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    for b in backends:
        if b not in BACKENDS:
            p.error(f"--backends: {b!r} is not one of {', '.join(BACKENDS)}")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch

    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = {b: {int(n): run(b, int(n), args.steps, args.before, args.cold) for n in args.sizes.split(",")}
            for b in backends}
    if args.json:
        print(json.dumps({"torch_threads": torch.get_num_threads(), "load_average": load, "cold": args.cold,
                          "rows": rows}))
        return 0
    print(f"attnplug's builders vs vLLM's, median µs per call ({torch.get_num_threads()} torch thread, "
          f"load average {load:.2f} at the start{', cold L1/L2' if args.cold else ''})")
    for b, by_n in rows.items():
        for n, r in by_n.items():
            parts = [f"{who} build {r[f'{who} build']:.2f} (update_block_table "
                     f"{r[f'{who} update_block_table']:.2f})" if f"{who} update_block_table" in r
                     else f"{who} build {r[f'{who} build']:.2f}" for who in ("ours", "before", "vllm")
                     if f"{who} build" in r]
            ratios = ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k.endswith("/ vllm build"))
            print(f"{b} N={n}: " + "; ".join(parts) + f"; {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
