"""``attnplug bench step``'s hybrid table: a state group's step with drafts, Mamba2 and GDN.

Workload: ``N`` decoding requests of one state layer, each kind three ways side by side,
interleaved, best of ``--repeat`` (float32, CPU):

* Mamba2: 8 heads x 16, state 16, one B/C group, conv kernel 4, chunk 64;
* GDN (Qwen3-Next's layer shape, scaled down): 2 key heads, 4 value heads, head dims 32,
  conv kernel 4, chunk 64;

and for each:

* ``decode``: one token per request (no drafts);
* ``verify k``: ``1 + k`` tokens per request, ``k`` drafts (``num_draft_tokens_cpu``): the
  builder's verifying layout, the recurrent update at each position with the state after
  each written to the row's block-table column (``backends/mamba2/verify.py``; GDN:
  ``GDNTorchImpl._verify``, the conv step and the delta rule per position), then the
  runner's commit (``runner/execute/spec_decode/state_commit.py``) for accepted counts drawn
  uniformly from ``0 .. k`` (seeded);
* ``prefill 1+k``: the same ``1 + k`` tokens per request as plain chunked-prefill
  continuations (no per-position states: what the step would cost if drafts needed none).

Stages: ``build`` (the metadata builder), ``forward`` (the impl's ``forward``), ``commit``
(the slot copies of one layer). The ratio column is each total over the same kind's decode step's.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from attnplug.core.metadata import CommonAttentionMetadata

STAGES = ("build", "forward", "commit")


KINDS = ("mamba2", "gdn")


def _layer(conv_dim: int, K: int, heads: int, seed: int = 0):
    import types

    g = torch.Generator().manual_seed(seed)
    return types.SimpleNamespace(conv1d=types.SimpleNamespace(weight=torch.randn(conv_dim, 1, K, generator=g) * 0.3,
                                                              bias=torch.zeros(conv_dim)),
                                 A_log=torch.zeros(heads), D=torch.ones(heads), dt_bias=torch.zeros(heads))


def _kind(kind: str):
    """``(backend, layer config, spec, input widths after the layer, output shape per token)``."""
    from attnplug.cache_groups.specs import MambaSpec

    if kind == "gdn":
        from attnplug.backends.state.gdn.backend import GDNTorchBackend
        from attnplug.core.gdn import GDNLayerConfig
        from attnplug.runner.models.qwen3_next import gdn_state_spec

        cfg = GDNLayerConfig(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32, conv_kernel_size=4,
                             chunk_size=64)
        return (GDNTorchBackend, cfg, gdn_state_spec(cfg, 16), (cfg.conv_dim, cfg.num_v_heads, cfg.num_v_heads),
                (cfg.num_v_heads, cfg.head_v_dim))
    from attnplug.backends.mamba2 import Mamba2Backend
    from attnplug.core.mamba import MambaLayerConfig

    cfg = MambaLayerConfig(num_heads=8, head_size=16, state_size=16, n_groups=1, conv_kernel_size=4, chunk_size=64)
    spec = MambaSpec(block_size=16, conv_state_shape=cfg.conv_state_shape, ssm_state_shape=cfg.ssm_state_shape,
                     dtype=torch.float32, ssm_dtype=torch.float32, chunk_size=64)
    return Mamba2Backend, cfg, spec, (cfg.conv_dim, cfg.num_heads), (cfg.intermediate_size,)


def _setup(num_reqs: int, k: int, kind: str = "mamba2"):
    from attnplug.core.contracts import BuilderConfig

    backend, cfg, spec, widths, out_shape = _kind(kind)
    per = 1 + k
    bcfg = BuilderConfig(max_num_reqs=num_reqs, max_num_batched_tokens=num_reqs * per, max_model_len=4096)
    builder = backend.get_builder_cls()(spec, ["state"], bcfg, "cpu")
    impl = backend.get_impl_cls()(cfg)
    state = backend.allocate_state_cache(spec, 1 + num_reqs * per, "cpu")
    for t in state:
        t.normal_()
    heads = widths[1]
    layer = _layer(widths[0], cfg.conv_kernel_size, heads)
    table = (1 + np.arange(num_reqs * per, dtype=np.int32)).reshape(num_reqs, per)
    return builder, impl, state, layer, widths, out_shape, table


def _common(num_reqs: int, q: int, table: np.ndarray, drafts: int) -> CommonAttentionMetadata:
    cm = CommonAttentionMetadata.from_lengths(num_computed_tokens=[100] * num_reqs, num_scheduled_tokens=[q] * num_reqs,
                                              block_table=table.tolist(), block_size=4096)
    if drafts:
        cm = cm.replace(num_draft_tokens_cpu=torch.full((num_reqs,), drafts, dtype=torch.int32))
    return cm


def time_mode(num_reqs: int, k: int, mode: str, num_steps: int, seed: int = 0,
              kind: str = "mamba2") -> dict[str, float]:
    """Median µs per stage of ``mode`` (``decode``, ``verify``, ``prefill``) over ``num_steps``
    on a ``kind`` (``"mamba2"``, ``"gdn"``) layer."""
    from attnplug.runner.step.spec_apply import draft_state_copies

    builder, impl, state, layer, widths, out_shape, table = _setup(num_reqs, k, kind)
    q = 1 if mode == "decode" else 1 + k
    cm = _common(num_reqs, q, table, k if mode == "verify" else 0)
    rng = np.random.default_rng(seed)
    ins = [torch.randn(num_reqs * q, w) * (1.0 if j == 0 else 0.1) for j, w in enumerate(widths)]
    out = torch.empty(num_reqs * q, *out_shape)
    times = np.zeros((num_steps, len(STAGES)))
    for i in range(num_steps + 2):   # two warm-up steps
        t0 = time.perf_counter_ns()
        md = builder.build(0, cm)
        t1 = time.perf_counter_ns()
        impl.forward(layer, *ins, state, md, out)
        t2 = time.perf_counter_ns()
        if mode == "verify":
            toks = [[1] * (int(a) + 1) for a in rng.integers(0, k + 1, size=num_reqs)]
            (src, dst), = draft_state_copies([table], list(range(num_reqs)), toks)
            s, d = torch.from_numpy(src), torch.from_numpy(dst)
            for t in state:
                t.index_copy_(0, d, t.index_select(0, s))
        t3 = time.perf_counter_ns()
        if i >= 2:
            times[i - 2] = (t1 - t0, t2 - t1, t3 - t2)
    t = times / 1e3
    res = {s: float(np.median(t[:, j])) for j, s in enumerate(STAGES)}
    res["total"] = float(np.median(t.sum(axis=1)))
    return res


def run_spec_state(num_reqs: int, k: int, num_steps: int, repeat: int, kinds=KINDS) -> list[dict]:
    """Rows ``{"workload", "kind", "times", "ratio_to_decode"}``: per kind, decode, verify
    ``k``, prefill ``1 + k``; interleaved replays, best of ``repeat`` by total."""
    modes = ("decode", "verify", "prefill")
    runs: dict[tuple[str, str], list[dict]] = {(kd, m): [] for kd in kinds for m in modes}
    for _ in range(max(1, repeat)):
        for kd in kinds:
            for m in modes:
                runs[(kd, m)].append(time_mode(num_reqs, k, m, num_steps, kind=kd))
    names = {"decode": "{} decode N=%d" % num_reqs, "verify": "{} verify N=%d, k=%d" % (num_reqs, k),
             "prefill": "{} prefill 1+%d tokens N=%d" % (k, num_reqs)}
    best = {key: min(r, key=lambda x: x["total"]) for key, r in runs.items()}
    return [{"workload": names[m].format(kd), "kind": kd, "times": best[(kd, m)],
             "ratio_to_decode": best[(kd, m)]["total"] / best[(kd, "decode")]["total"]}
            for kd in kinds for m in modes]


def render_spec_state(rows: list[dict], markdown: bool) -> str:
    """The table (markdown text, or printed with rich and "" returned)."""
    from attnplug.runner.commands.bench.timing import render_stage_table

    header = ["workload", "stage", "µs", "x decode step"]
    lines = [[r["workload"] if s == STAGES[0] else "", s, f"{r['times'][s]:,.1f}",
              f"{r['ratio_to_decode']:.2f}" if s == "total" else ""] for r in rows for s in (*STAGES, "total")]
    return render_stage_table(f"attnplug bench step — hybrid (Mamba2, GDN) step with drafts, median µs per step "
                              f"({torch.get_num_threads()} torch thread(s))", header, lines, markdown)
