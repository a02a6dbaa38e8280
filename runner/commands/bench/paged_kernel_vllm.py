"""The vLLM side of ``attnplug bench paged-kernel``: vLLM's CPU attention op on a case file.

Run as a script (``PYTHON path/to/paged_kernel_vllm.py``) with the Python of an environment
that has vLLM's CPU build; it imports only torch, vLLM and ``median_time.py`` beside it
(not attnplug: that environment's attnplug may be another checkout). It answers one line per command on stdin:

* ``time CASE.pt THREADS ITERS WARMUP`` -> ``TIME {"us": median µs, "torch_threads": n,
  "isa": ...}``, after writing its output to ``CASE.pt.vllm-out.pt`` (the parent compares it
  with attnplug's). ``CASE.pt`` is what ``bench/paged_kernel.py`` saved: ``query`` ``[T, H,
  D]``, ``kv_cache`` in attnplug's layout ``[num_blocks, 2, block_size, H_kv, D]``,
  ``block_table`` / ``query_start_loc`` / ``seq_lens`` (int32), ``scale``;
* ``quit`` (or the end of stdin) stops.

vLLM's op (``vllm._custom_ops.cpu_attention_with_kv_cache``) takes its cache as
``[num_blocks, H_kv, 2 * block_size, D]`` (K in the first ``block_size`` rows of each
head's block, V in the rest: the view ``CPUAttentionBackendImpl.forward`` makes of its
``[num_blocks, H_kv, block_size, 2 * D]`` allocation), written by its own
``cpu_attn_reshape_and_cache`` (the ISA's K/V packing; every slot of every block, outside
the timing), and a scheduler metadata tensor built
once per step by ``cpu_attn_get_scheduler_metadata``: built here once per case and thread
count (it splits the work for that many threads), outside the timing, as its builder does once per step for every layer. The ISA is the one vLLM's
``_get_attn_isa`` picks for the dtype, block size and head size.
"""

from __future__ import annotations

import json
import sys

from median_time import median_us  # this script's directory (run by path): bench/median_time.py


def _case(path: str):
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    c = torch.load(path)
    q, kv = c["query"], c["kv_cache"]
    nb, _, bs, hkv, d = kv.shape
    isa = _get_attn_isa(q.dtype, bs, d)
    cache = torch.zeros(nb, hkv, 2 * bs, d, dtype=kv.dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(kv[:, 0].reshape(nb * bs, hkv, d), kv[:, 1].reshape(nb * bs, hkv, d), key_cache,
                                   value_cache, torch.arange(nb * bs, dtype=torch.int64), isa)
    num_reqs = c["seq_lens"].shape[0]
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs, num_heads=q.shape[1], num_kv_heads=hkv, head_dim=d, seq_lens=c["seq_lens"],
        dtype=q.dtype, query_start_loc=c["query_start_loc"], causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=True)
    out = torch.zeros_like(q)

    def call():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=c["query_start_loc"], seq_lens=c["seq_lens"], scale=c["scale"], causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=c["block_table"], softcap=0.0,
            scheduler_metadata=sched, s_aux=None)

    return call, out, isa


def main() -> int:
    import torch

    cases: dict = {}
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        path, threads, iters, warmup = words[1], int(words[2]), int(words[3]), int(words[4])
        torch.set_num_threads(threads)
        if (path, threads) not in cases:  # the scheduler metadata is built for a thread count
            cases[path, threads] = _case(path)
        call, out, isa = cases[path, threads]
        us = median_us(call, iters, warmup)
        torch.save(out, path + ".vllm-out.pt")
        print("TIME " + json.dumps({"us": us, "torch_threads": torch.get_num_threads(),
                                    "isa": isa}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
