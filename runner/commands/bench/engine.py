"""``attnplug bench engine``: the same model, prompts and limits through attnplug's engine and
through vLLM's ``LLM.generate`` (its CPU build, in a subprocess), alternating, in one command
(docs/performance.md, "The engine against vLLM's CPU build").

For each ``--model`` (a random-weight preset such as ``tiny-llama``, or ``smollm2``: real
weights) attnplug builds its engine as ``attnplug run`` does (the prompts: the preset's
token ids of the bundled trace's lengths, or the bundled chat prompts; every request decodes
greedily for exactly ``--output-len`` tokens, EOS ignored), and writes the model's weights —
the very tensors attnplug runs, dequantised for SmolLM2 — with the model's HF ``config.json``
as a checkpoint directory that vLLM loads. For each ``--threads`` count, vLLM's engine starts
once in a subprocess of ``--vllm-python`` (``bench/engine_vllm.py``; torch and OpenMP threads =
the count), then ``--repeat`` rounds each run the workload once on a fresh attnplug engine
and once on vLLM's, the order swapped every round.

Figures per engine (median over rounds): generated tokens/s (generated tokens ÷ wall time of
the run), forward ms/step (the model body's mean wall time per step: attnplug's ``forward``
stage, vLLM's model ``forward`` call; neither includes the LM head or the sampler), host
ms/step (wall time per step minus forward: scheduling, input preparation, LM head, sampling,
output handling) and steps; the ratio attnplug ÷ vLLM of generated tokens/s (median of the
rounds' ratios; > 1: attnplug faster). Greedy agreement: requests whose tokens are identical,
and the mean share of each request's tokens before the first difference (``--dtype``, float32
by default, on both sides; different matmul and attention kernels may flip a near-tie). ``--json``: the same, with
``ratio_tokens_per_s`` per model and thread count. Exit status 2 for bad flags or a missing
vLLM (one line), 1 when the vLLM subprocess fails.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands import threads
from attnplug.runner.commands.limits import OneLineParser, bounded_int

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEFAULT_VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "0.32", "bin", "python")
"""The vLLM 0.32 CPU environment ``make .venv-vllm/0.32/.test`` builds in the checkout."""


def _parser() -> OneLineParser:
    p = OneLineParser(prog="attnplug bench engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama",
                   help="comma-separated: presets (tiny-llama, ...) and/or smollm2 (default tiny-llama)")
    p.add_argument("--threads", default="1", help="comma-separated torch thread counts (default 1)")
    p.add_argument("--repeat", type=bounded_int(1, 100), default=3, help="rounds per model and thread count")
    p.add_argument("--num-requests", type=bounded_int(1, 100_000), default=64)
    p.add_argument("--output-len", type=bounded_int(1, 2**16), default=128, help="generated tokens per request")
    p.add_argument("--max-num-seqs", type=bounded_int(1, 4096), default=64)
    p.add_argument("--max-num-batched-tokens", type=bounded_int(16, 2**20), default=2048)
    p.add_argument("--block-size", type=bounded_int(1, 2**16), default=32,
                   help="KV block size, both engines (default 32: vLLM's CPU attention needs a multiple of 32)")
    p.add_argument("--max-model-len", type=bounded_int(16, 2**20), default=1024)
    p.add_argument("--backend", default=None, help="attnplug's attention backend (default: the automatic choice)")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                   help="the Python of an environment with vLLM's CPU build (default .venv-vllm/0.32/bin/python); "
                        "'none' runs attnplug alone")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="model, activation and KV-cache dtype of both engines (default float32)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _run_args(args, model: str):
    from attnplug.runner.commands import real_run
    from attnplug.runner.commands.run import _parser as run_parser

    argv = ["--model", model, "--num-requests", str(args.num_requests), "--output-len", str(args.output_len),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
            "--invariance-requests", "0"]
    if args.backend:
        argv += ["--backend", args.backend]
    run_args = run_parser().parse_args(argv)
    why = real_run.resolve_defaults(run_args)
    if why is not None:
        raise AttnplugError(why)
    return run_args


def hf_config(model_name: str) -> dict:
    """The HF ``config.json`` dict of a preset or of a GGUF model (``smollm2``)."""
    from attnplug.runner.models import presets
    from attnplug.runner.models.gguf import is_gguf_model

    if is_gguf_model(model_name):
        from attnplug.runner.models.gguf import resolve_path
        from attnplug.runner.models.gguf.reader import hf_config as gguf_config, open_gguf

        path = resolve_path(model_name)
        return gguf_config(open_gguf(path), path)
    return presets.preset_config("tiny-llama" if model_name == "preset" else model_name)


def write_checkpoint(model: torch.nn.Module, config: dict, directory: str) -> str:
    """Save ``model``'s parameters (HF names: ``runner/models/llama.py``) as
    ``directory/model.safetensors`` in float32 with ``config.json``; returns ``directory``.
    A tied ``lm_head.weight`` is stored once (as ``model.embed_tokens.weight``)."""
    from safetensors.torch import save_file

    tensors = {name: p.detach().float().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config, torch_dtype="float32")
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return directory


def _attnplug_run(run_args, model, n_threads: int) -> dict:
    import dataclasses

    from attnplug.runner.commands import replay, serving_flags
    from attnplug.runner.commands.assemble import build_engine, kv_cache_bytes

    torch.set_num_threads(n_threads)
    if threads.binding_asked(os.environ):  # ATTNPLUG_OMP_BIND=1 (runner/commands/threads.py)
        threads.bind(n_threads)
    setup = build_engine(run_args, model=model)
    for rid, sp in setup.sampling_params.items():  # EOS ignored: every request makes --output-len tokens
        setup.sampling_params[rid] = dataclasses.replace(sp, stop_token_ids=())
    m = replay.measure(setup, serving_flags.plan(run_args, setup))
    s = m.summary
    steps = s["steps"]
    forward_s = sum(setup.engine.runner.timings_ns["forward"]) / 1e9
    return {"wall_s": m.wall_s, "steps": steps, "forward_s": forward_s, "generated_tokens": s["generated_tokens"],
            "load_average_1m": os.getloadavg()[0], "outputs_digest": s["outputs_digest"],
            "tokens": [list(m.results[rid].output_token_ids) for rid in setup.prompts],
            "kv_cache_bytes": kv_cache_bytes(setup.kv_cache_config),
            "prompts": setup.prompts, "max_tokens": [setup.sampling_params[r].max_tokens for r in setup.prompts]}


class VllmWorker:
    """vLLM's engine in a subprocess (``engine_vllm.py --serve``): one ``LLM`` for its life,
    one measured ``generate`` per :meth:`run`."""

    def __init__(self, python: str, spec: dict, n_threads: int, workdir: str):
        path = os.path.join(workdir, f"spec-{n_threads}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        env = {**os.environ, "OMP_NUM_THREADS": str(n_threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "ATTNPLUG_TORCH_THREADS": str(n_threads)}
        self.proc = subprocess.Popen([python, "-m", "attnplug.runner.commands.bench.engine_vllm", path, "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read("READY")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise AttnplugError(f"the vLLM subprocess ended (exit status {self.proc.wait()}) before {tag}: see its stderr")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read("RUN")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)


def per_step(run: dict) -> dict:
    """``run``'s figures: generated tokens/s, forward and host ms per step."""
    steps = max(run["steps"], 1)
    return {"generated_tokens_per_s": run["generated_tokens"] / run["wall_s"],
            "forward_ms_per_step": 1e3 * run["forward_s"] / steps,
            "host_ms_per_step": 1e3 * (run["wall_s"] - run["forward_s"]) / steps, "steps": run["steps"]}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Greedy agreement of two runs' tokens, request by request: identical requests and the
    mean share of tokens before the first difference."""
    same, shares = 0, []
    for a, b in zip(ours, theirs):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        shares.append(k / max(len(a), len(b), 1))
    return {"identical_requests": same, "requests": len(ours), "mean_prefix_share": statistics.mean(shares)}


def _summarise(runs: list[dict]) -> dict:
    figs = [per_step(r) for r in runs]
    return {k: statistics.median(f[k] for f in figs) for k in figs[0]}


def _vllm_spec(args, run_args, ckpt: str, probe: dict) -> dict:
    return {"model": ckpt, "prompts": list(probe["prompts"].values()), "max_tokens": probe["max_tokens"],
            "seed": run_args.seed, "dtype": args.dtype,
            "engine": {"max_num_seqs": args.max_num_seqs, "block_size": args.block_size,
                       "max_num_batched_tokens": args.max_num_batched_tokens,
                       "max_model_len": args.max_model_len, "enable_prefix_caching": False,
                       "kv_cache_memory_bytes": probe["kv_cache_bytes"]}}


def bench_model(args, model_name: str, counts: list[int], workdir: str) -> list[dict]:
    """Every thread count's rows for one model (module docstring)."""
    from attnplug.runner.commands.assemble import build_engine

    from attnplug.runner.commands.model_loading import load_model_for_run
    from attnplug.runner.commands.assemble import resolve_backend

    run_args = _run_args(args, model_name)
    dtype = getattr(torch, args.dtype)
    model = load_model_for_run(run_args.model, backend=run_args.backend, block_size=run_args.block_size,
                               seed=run_args.seed, resolve=resolve_backend, dtype=dtype)
    model = build_engine(run_args, requests=False, model=model).model
    ckpt = None
    if args.vllm_python != "none":
        ckpt = write_checkpoint(model, hf_config(model_name), tempfile.mkdtemp(dir=workdir))
    rows = []
    for n in counts:
        warm = _attnplug_run(run_args, model, n)  # warm-up (vLLM's: in its worker); gives the requests
        worker = VllmWorker(args.vllm_python, _vllm_spec(args, run_args, ckpt, warm), n, workdir) if ckpt else None
        ours, theirs, ratios = [], [], []
        try:
            for r in range(args.repeat):
                if worker is not None and r % 2 == 1:
                    theirs.append(worker.run())
                ours.append(_attnplug_run(run_args, model, n))
                if worker is not None and r % 2 == 0:
                    theirs.append(worker.run())
                if worker is not None:
                    ratios.append(per_step(ours[-1])["generated_tokens_per_s"]
                                  / per_step(theirs[-1])["generated_tokens_per_s"])
        finally:
            if worker is not None:
                worker.close()
        row = {"model": model_name, "torch_threads": n, "dtype": args.dtype, "rounds": args.repeat,
               "attnplug": _summarise(ours),
               "attnplug_backend": sorted({b.get_name() for b in model.attnplug_backends.values()}),
               "outputs_identical_across_rounds": len({o["outputs_digest"] for o in ours}) == 1,
               "outputs_digest": ours[-1]["outputs_digest"],
               "load_average_1m": [o["load_average_1m"] for o in ours]}
        if worker is not None:
            row.update(vllm=_summarise(theirs), vllm_torch_threads=worker.info["torch_threads"],
                       vllm_version=worker.info["vllm_version"], ratio_tokens_per_s=statistics.median(ratios),
                       agreement=agreement(ours[-1]["tokens"], theirs[-1]["tokens"]))
        rows.append(row)
        print(f"attnplug bench engine: {model_name}, {n} thread(s) done: " + json.dumps(row), file=sys.stderr,
              flush=True)  # a long run's finished rows survive an interruption
    return rows


def render(report: dict) -> str:
    """The markdown table of a :func:`main` report."""
    lines = ["| model | threads | engine | generated tok/s | forward ms/step | host ms/step | steps | "
             "attnplug / vLLM tok/s | greedy agreement |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for row in report["rows"]:
        for eng in ("attnplug", "vllm"):
            if eng not in row:
                continue
            f = row[eng]
            ratio = f"**{row['ratio_tokens_per_s']:.2f}**" if eng == "vllm" else ""
            agree = ""
            if eng == "vllm":
                a = row["agreement"]
                agree = f"{a['identical_requests']}/{a['requests']} identical, {100 * a['mean_prefix_share']:.0f}% prefix"
            name = f"attnplug ({', '.join(row['attnplug_backend'])})" if eng == "attnplug" else \
                f"vLLM {row['vllm_version']} ({row['vllm_torch_threads']} thr)"
            lines.append(f"| {row['model']} | {row['torch_threads']} | {name} | {f['generated_tokens_per_s']:,.0f} | "
                         f"{f['forward_ms_per_step']:.2f} | {f['host_ms_per_step']:.2f} | {f['steps']:.0f} | "
                         f"{ratio} | {agree} |")
    lines.append(f"\n{report['repeat']} rounds per row, alternating; {report.get('dtype', 'float32')}; "
                 f"{report['num_requests']} requests x "
                 f"{report['output_len']} tokens; CPUs usable: {report['usable_cpus']}; load average at start / "
                 f"end: {report['load_start'][0]:.2f} / {report['load_end'][0]:.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``attnplug bench engine [--model M[,M]] [--threads 1,2] [--repeat N] [--json] ...``"""
    args = _parser().parse_args(argv)
    try:
        models = _csv(args.model) or ["tiny-llama"]
        counts = [threads._parse(x, "--threads") for x in _csv(args.threads)]  # noqa: SLF001
        if not counts:
            raise ValueError("--threads needs at least one thread count")
        threads.binding_asked(os.environ)  # a bad ATTNPLUG_OMP_BIND: one line, exit 2
    except ValueError as e:
        print(f"attnplug bench engine: {e}", file=sys.stderr)
        return 2
    if args.vllm_python != "none" and not os.path.exists(args.vllm_python):
        print(f"attnplug bench engine: --vllm-python {args.vllm_python!r} does not exist (build it with "
              "`make .venv-vllm/0.32/.test`, or pass --vllm-python none)", file=sys.stderr)
        return 2
    before = torch.get_num_threads()
    load_start = list(os.getloadavg())
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="attnplug-bench-engine-") as workdir:
            for m in models:
                rows += bench_model(args, m, counts, workdir)
    except AttnplugError as e:
        print(f"attnplug bench engine: {e}", file=sys.stderr)
        return 1 if "vLLM subprocess" in str(e) else 2
    finally:
        torch.set_num_threads(before)
    report = {"repeat": args.repeat, "dtype": args.dtype, "num_requests": args.num_requests, "output_len": args.output_len,
              "limits": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                         "block_size": args.block_size, "max_model_len": args.max_model_len},
              "usable_cpus": threads.usable_cpus(), "load_start": load_start, "load_end": list(os.getloadavg()),
              "rows": rows}
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
