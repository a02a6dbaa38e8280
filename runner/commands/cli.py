"""The ``attnplug`` command line: one subcommand per module, imported lazily.

Each subcommand module exposes ``main(argv: list[str]) -> int``.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("attnplug.runner.commands.run", "replay a trace through the engine (the main job)"),
    "explain": ("attnplug.runner.commands.explain", "print one step's metadata per JSONL step"),
    "bench": ("attnplug.runner.commands.bench.step", "benchmarks: `bench step`, `bench attention` (CUDA)"),
    "parity": ("attnplug.runner.commands.parity", "compare greedy tokens and logits with HF transformers"),
    "backends": ("attnplug.runner.commands.backends", "list registered backends; --explain --model X: selection"),
    "check": ("attnplug.runner.commands.check", "run the conformance suite against a backend"),
}


def _usage() -> str:
    lines = ["usage: attnplug COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`attnplug COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"attnplug: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[cmd][0])
    return int(module.main(rest) or 0)
