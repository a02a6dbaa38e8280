"""The ``attnplug`` command line: one subcommand per module, imported lazily.

Each subcommand module exposes ``main(argv: list[str]) -> int``.

Output into a closed pipe (``attnplug explain steps.jsonl | head -1``) ends the command the
way a Unix filter ends on ``SIGPIPE``: silently, with exit status :data:`EXIT_BROKEN_PIPE`
(128 + SIGPIPE), and nothing more is written to stdout (it is pointed at ``os.devnull``,
so the interpreter's last flush cannot fail either; the recipe of the Python docs,
https://docs.python.org/3/library/signal.html#note-on-sigpipe).
"""

from __future__ import annotations

import importlib
import os
import sys

from attnplug.runner.commands import threads

EXIT_BROKEN_PIPE = 128 + 13
"""Exit status when stdout's reader went away: 128 + SIGPIPE, as a shell reports a filter
killed by SIGPIPE."""

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("attnplug.runner.commands.run", "replay a trace through the engine (the main job)"),
    "serve": ("attnplug.runner.commands.serve", "an OpenAI-compatible server over the engine (docs/serving.md)"),
    "explain": ("attnplug.runner.commands.explain", "print one step's metadata per JSONL step"),
    "bench": ("attnplug.runner.commands.bench.step", "benchmarks: `bench step`, `bench attention` (CUDA), `bench moe`, `bench threads`, `bench engine` (attnplug against vLLM's CPU build), `bench paged-kernel` (one paged-attention call against vLLM's CPU op), `bench linear` (a CPU linear: torch's oneDNN op against oneDNN's C API), `bench serve` (a server under load)"),
    "parity": ("attnplug.runner.commands.parity", "compare greedy tokens and logits with HF transformers"),
    "backends": ("attnplug.runner.commands.backends", "list registered backends; --explain --model X: selection"),
    "check": ("attnplug.runner.commands.check", "run the conformance suite against a backend"),
}


def _usage() -> str:
    lines = ["usage: attnplug COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`attnplug COMMAND --help` for a command's options; `attnplug --version` for the version."]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version (``importlib.metadata``), else
    ``attnplug.__version__`` (a source tree that is not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("attnplug")
    except importlib.metadata.PackageNotFoundError:
        import attnplug

        return attnplug.__version__


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"attnplug {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"attnplug: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if cmd in threads.WAIT_POLICY_COMMANDS:
        threads.load_torch_waiting_passively()  # before anything loads torch (threads.py)
    from attnplug.core import switches  # (loads torch: after the wait policy)
    from attnplug.core.errors import ConfigError

    try:
        switches.check_environment()  # a bad ATTNPLUG_* switch: one line, before the command runs
    except ConfigError as e:
        print(f"attnplug {cmd}: {e}", file=sys.stderr)
        return 2
    if cmd in threads.WAIT_POLICY_COMMANDS:
        from attnplug.runner.commands import heap

        heap.keep_freed_memory()  # prefill temporaries are not faulted in again each step (heap.py)
    module = importlib.import_module(SUBCOMMANDS[cmd][0])
    try:
        status = int(module.main(rest) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        return stdout_closed()
    return status


def stdout_closed() -> int:
    """Point stdout at ``os.devnull`` (its reader is gone) and return :data:`EXIT_BROKEN_PIPE`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (tests' capture)
        pass
    return EXIT_BROKEN_PIPE
