"""``attnplug bench serve --base-url URL [run's flags]``: a load generator for ``attnplug serve``
(or any OpenAI-compatible server), side by side with ``attnplug run``'s replay of the same load.

The load is ``attnplug run``'s, built by its own code (``run``'s parser, ``build_engine``,
``serving_flags.plan``): the same prompts (token ids, chat template applied), ``max_tokens``,
stop tokens, sampling and arrival times (``--request-rate`` / ``--burstiness`` / ``--seed``).
Each request goes out at its arrival time as a streamed ``/v1/completions`` call with the
prompt's token ids (``ignore_eos`` plus the request's own ``stop_token_ids``, so the server
stops exactly where the replay does), through the ``openai`` client. The client records,
per request, the send time and the arrival time of every chunk that carries text (as
``vllm bench serve`` does: TTFT is the first such chunk, each later one is one ITL gap)
and takes the output tokens from ``usage``; the figures are ``serving_metrics.py``'s,
the definitions ``attnplug run`` reports.

With ``--compare-replay`` (default on) the same load is then replayed in this process
(``replay.measure`` on a fresh engine, as ``attnplug run`` does) and a table prints each
figure for the server (as its client saw it), the replay, and the ratio; torch threads of
both sides are recorded (the server's from its ``/metrics``), and so are the server's own
mean TTFT / ITL / E2E of the same requests from its ``/metrics`` histograms
(``engine_mean_*_ms``: the client's means minus these are the HTTP and streaming overhead,
measured in one run). ``--json`` prints both
summaries instead. The server must serve the same model and engine flags.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import torch

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands import run
from attnplug.runner.commands.serving_metrics import LATENCY_METRICS, serving_metrics
from attnplug.runner.serve.request_timing import RequestTiming

SHOWN = [f"{s}_{m}_ms" for m in LATENCY_METRICS for s in ("mean", "median", "p99")] + \
    ["duration", "request_throughput", "output_throughput", "completed", "total_output_tokens"]
"""Figures of the comparison table."""


def _parser():
    p = run._parser()
    p.prog = "attnplug bench serve"
    p.description = __doc__.splitlines()[0]
    p.add_argument("--base-url", required=True, metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model-name", default=None, metavar="NAME", help="model id to send (default --model)")
    p.add_argument("--no-compare-replay", action="store_true", help="only the client's figures")
    return p


async def _one(client, model: str, prompt: list[int], sp, start: float) -> tuple[RequestTiming, int, str]:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    timing = RequestTiming(time.perf_counter())
    extra = {"ignore_eos": True, "stop_token_ids": list(sp.stop_token_ids)}
    if sp.top_k:
        extra["top_k"] = sp.top_k
    n_out, pieces = 0, []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=sp.max_tokens,
                                             temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                                             stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if chunk.usage is not None:
            n_out = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            timing.chunk_times.append(time.perf_counter())
            timing.chunk_tokens.append(1)
            pieces.append(chunk.choices[0].text)
    return timing, n_out, "".join(pieces)


async def _drive(args, setup, plan, before: dict) -> tuple[dict, dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key="none", max_retries=0,
                                timeout=3600)
    model = args.served_model_name or args.model
    rids = list(setup.prompts)
    for rid, prompt, sp in plan.warmup:  # one at a time, left out of every figure
        await _one(client, model, prompt, sp, 0.0)
    before.update(_scrape(args.base_url))  # (blocking, before the timed part)
    t0 = time.perf_counter() + 0.05
    done = await asyncio.gather(*(_one(client, model, setup.prompts[r], setup.sampling_params[r],
                                       t0 + plan.arrival_s[r]) for r in rids))
    await client.close()
    timings = [d[0] for d in done]
    ends = [t.chunk_times[-1] for t in timings if t.chunk_times]
    summary = serving_metrics(timings, [len(setup.prompts[r]) for r in rids], [d[1] for d in done],
                              max(max(ends, default=t0) - t0, 1e-9), plan.goodput, plan.percentiles)
    return summary, {r: d[2] for r, d in zip(rids, done)}


def _scrape(base_url: str) -> dict[str, float]:
    """The server's ``/metrics`` samples without labels (``{}`` for a server without them)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if not s.labels}
    except Exception:
        return {}


def _engine_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean TTFT / ITL / E2E of this load as the server's engine saw them (its histograms'
    ``_sum`` / ``_count`` over the run, ms): the client's figures minus these are the HTTP,
    streaming and client overhead, measured in the same run."""
    out: dict[str, float | None] = {"torch_threads": after.get("attnplug_torch_num_threads")}
    for key, name in (("ttft", "time_to_first_token"), ("itl", "inter_token_latency"),
                      ("e2el", "e2e_request_latency")):
        base = f"attnplug_{name}_seconds"
        n = after.get(base + "_count", 0.0) - before.get(base + "_count", 0.0)
        total = after.get(base + "_sum", 0.0) - before.get(base + "_sum", 0.0)
        out[f"engine_mean_{key}_ms"] = 1000.0 * total / n if n else None
    return out


def _table(server: dict, replay: dict | None) -> None:
    from rich.table import Table

    from attnplug.runner.commands.report import Console

    t = Table(title="attnplug serve (client-measured) vs attnplug run replay, same load")
    for col in ("metric", "server", "replay", "server / replay"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for key in SHOWN + ["engine_mean_ttft_ms", "engine_mean_itl_ms", "engine_mean_e2el_ms", "torch_threads"]:
        a, b = server.get(key), (replay or {}).get(key)
        ratio = f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"
        t.add_row(key, _fmt(a), _fmt(b), ratio)
    Console().print(t)


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def main(argv: list[str]) -> int:
    from attnplug.runner.commands import real_run, replay, serving_flags
    from attnplug.runner.commands.assemble import build_engine

    args = _parser().parse_args(argv)
    args.invariance_requests = 0
    if (why := real_run.resolve_defaults(args) or serving_flags.check(args)) is not None:
        print(f"attnplug bench serve: {why}", file=sys.stderr)
        return 2
    try:
        setup = build_engine(args)
        plan = serving_flags.plan(args, setup)
        replay.validate(setup, plan)
    except AttnplugError as e:
        print(f"attnplug bench serve: {e}", file=sys.stderr)
        return 2
    before: dict[str, float] = {}
    server, texts = asyncio.run(_drive(args, setup, plan, before))
    server.update(_engine_side(before, _scrape(args.base_url)))
    out = {"server": server, "arrivals": plan.arrivals, "model": args.model}
    if not args.no_compare_replay:
        measured = replay.measure(setup, plan)
        rep = {k: measured.summary.get(k) for k in set(SHOWN) | set(server)}
        rep["torch_threads"] = torch.get_num_threads()
        same = sum(texts[r] == _replay_text(setup, measured.results[r]) for r in texts)
        out.update(replay=rep, identical_texts=f"{same}/{len(texts)}")
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        _table(server, out.get("replay"))
        if "identical_texts" in out:
            print(f"completions identical to the replay's: {out['identical_texts']}")
    return 0


def _replay_text(setup, result) -> str:
    """The replay's completion as the server writes it (a preset: the byte-level tokenizer
    ``attnplug serve`` gives it)."""
    tok = getattr(setup.model, "attnplug_tokenizer", None)
    if tok is None:
        from attnplug.runner.api.byte_tokenizer import byte_tokenizer

        tok = setup.model.attnplug_tokenizer = byte_tokenizer(setup.model.config.vocab_size)
    return tok.decode(result.output_token_ids)
