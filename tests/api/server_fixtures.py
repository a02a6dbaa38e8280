"""A server on a free loopback port, in-process (uvicorn on a thread), and the engine of
``attnplug run`` built with the same flags for offline references."""

from __future__ import annotations

import contextlib

PRESET_FLAGS = ["--model", "tiny-llama", "--max-model-len", "128", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "64", "--block-size", "16"]
"""Random weights, small limits: each step a few ms on one CPU thread."""


@contextlib.contextmanager
def running_server(flags: list[str]):
    """``(BackgroundServer, app)`` for ``attnplug serve FLAGS`` (``--port`` is ignored: a free port)."""
    from attnplug.runner.api.server import BackgroundServer
    from attnplug.runner.commands import serve

    app = serve.build_app(serve.parse(flags))
    with BackgroundServer(app) as srv:
        yield srv, app


def offline_greedy(flags: list[str], prompts: dict[str, list[int]], max_tokens: dict[str, int]) -> dict[str, list[int]]:
    """Greedy outputs of ``prompts`` from the engine ``attnplug run`` builds with ``flags``."""
    from attnplug.runner.commands import serve
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.step.scheduler_output import SamplingParams

    args = serve.parse(flags)
    setup = build_engine(args, requests=False)
    tok = getattr(setup.model, "attnplug_tokenizer", None)
    eos = tok.eos_token_id if tok is not None else 257  # the byte tokenizer's <|im_end|>
    for rid, p in prompts.items():
        setup.engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens[rid],
                                                        stop_token_ids=(eos,)))
    return {rid: list(r.output_token_ids) for rid, r in setup.engine.run().items()}


def pools_full(app) -> bool:
    """Every cache group's pool has all its blocks free (no request holds any)."""
    kv = app.state.engine_loop.engine.scheduler.kv_cache_manager
    return all(p.num_free_blocks == p.capacity for p in kv.pools)
