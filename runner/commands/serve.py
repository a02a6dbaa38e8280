"""``attnplug serve``: an OpenAI-compatible server over the engine (docs/serving.md).

The engine is built exactly as ``attnplug run`` builds it: the same parser (``run._parser``,
so every engine flag of ``run`` — model, backends, limits, prefix caching, speculation,
asynchronous scheduling, tensor / pipeline parallelism under torchrun — is spelled and
checked the same) and the same ``assemble.build_engine``; ``serve`` adds ``--host``,
``--port``, ``--served-model-name`` and ``--max-queue-len``, and refuses ``run``'s replay
flags (the trace, arrivals, sampling, reports), whose job the clients do here. Requests
beyond ``--max-num-seqs`` running plus ``--max-queue-len`` waiting get HTTP 503.
"""

from __future__ import annotations

import argparse
import sys

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands import kv_cache_setup, real_run, run, run_parallel, threads
from attnplug.runner.commands.limits import bounded_int

REPLAY_FLAGS = ("trace", "num_requests", "prompts", "invariance_requests", "skip_invalid", "shared_prefixes",
                "system_prompts", "system_prompt_len", "json", "plot", "request_rate", "trace_timestamps",
                "burstiness", "time_scale", "timed_trace_chunk_hash_size", "goodput", "metric_percentiles",
                "warmup", "repeat", "temperature", "top_p", "top_k", "output_len")
"""``attnplug run``'s flags that shape its replay, not the engine: refused by ``serve``."""


def parser():
    """``run``'s parser, renamed, plus the server's own flags."""
    p = run._parser()
    p.prog = "attnplug serve"
    p.usage = "attnplug serve [--host H] [--port N] [--max-queue-len N] [--served-model-name NAME] [ENGINE FLAGS of run]"
    for action in p._actions:  # still parsed (to name them when refused), not listed
        if action.dest in REPLAY_FLAGS:
            action.help = argparse.SUPPRESS
    p.description = "An OpenAI-compatible server over the engine (docs/serving.md)."
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=bounded_int(0, 65535), default=8000, metavar="N",
                   help="port to listen on (0: any free port, printed at start)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the --model value)")
    p.add_argument("--max-queue-len", type=bounded_int(0, 1_000_000), default=256, metavar="N",
                   help="requests that may wait beyond the --max-num-seqs running ones; more get HTTP 503")
    return p


def parse(argv: list[str]):
    """Parsed flags; a replay flag of ``run`` is a one-line error (``SystemExit(2)``)."""
    p = parser()
    args = p.parse_args(argv)
    for dest in REPLAY_FLAGS:
        if getattr(args, dest) != p.get_default(dest):
            p.error(f"--{dest.replace('_', '-')} shapes `attnplug run`'s replay; the server's requests come "
                    "from its clients")
    return args


def build_app(args):
    """The engine (``assemble.build_engine``) and the FastAPI app over it.

    Raises:
        AttnplugError: what ``build_engine`` refuses, or a model without a tokenizer whose
            vocabulary is too small for the byte-level one.
    """
    from attnplug.runner.api.app import create_app
    from attnplug.runner.api.byte_tokenizer import MIN_VOCAB_SIZE, byte_tokenizer
    from attnplug.runner.api.prepare import ServedModel
    from attnplug.runner.commands.assemble import build_engine

    setup = build_engine(args, requests=False)
    tok = getattr(setup.model, "attnplug_tokenizer", None)
    vocab = setup.model.config.vocab_size
    if tok is None:
        if vocab < MIN_VOCAB_SIZE:
            raise AttnplugError(f"--model {args.model}: no tokenizer, and its vocabulary ({vocab}) is too small "
                                f"for the byte-level one ({MIN_VOCAB_SIZE} ids)")
        tok = byte_tokenizer(vocab)
    sched = setup.engine.scheduler
    served = ServedModel(args.served_model_name or args.model, tok, vocab, sched.config, sched.kv_cache_manager)
    return create_app(served, setup.engine, args.max_num_seqs + args.max_queue_len)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if (problem := real_run.resolve_defaults(args)) is not None:
        print(f"attnplug serve: {problem}", file=sys.stderr)
        return 2
    if (why := kv_cache_setup.flag_problem(args)) is not None:
        print(f"attnplug serve: {why}", file=sys.stderr)
        return 2
    if (status := threads.apply(args.torch_threads, "attnplug serve")) is not None:
        return status  # a bad --torch-threads / ATTNPLUG_TORCH_THREADS: one line, exit 2
    if run_parallel.wanted(args):  # under torchrun: rank 0 serves, the others follow its steps
        return run_parallel.run(args, lambda: _main(args))
    return _main(args)


def _main(args) -> int:
    from attnplug.runner.api.server import bind, make_server

    try:
        app = build_app(args)
        sock = bind(args.host, args.port)
    except AttnplugError as e:
        print(f"attnplug serve: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"attnplug serve: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    print(f"attnplug serve: http://{host}:{port}/v1 serving {app.state.served.name!r}", file=sys.stderr, flush=True)
    make_server(app, "info").run(sockets=[sock])
    return 0
