"""What ``attnplug run`` does differently with real weights (``--model smollm2`` or a
``.gguf`` path, the default): its defaults, and the completions it reports.

The default is sized so that ``make run`` ends within about three minutes on a 2-core CPU,
install included (docs/real-weights.md has the measurement); flags scale it up.
"""

from __future__ import annotations

from typing import Any

RUN_MODEL = "smollm2"
"""``attnplug run``'s default ``--model``."""
REAL_NUM_REQUESTS = 8
"""``--num-requests`` default with real weights and the bundled prompts."""
PRESET_NUM_REQUESTS = 48
"""``--num-requests`` default with a random-weight preset or HF config."""
REAL_INVARIANCE_REQUESTS = 1
"""``--invariance-requests`` default with real weights (each re-runs a request alone)."""
PRESET_INVARIANCE_REQUESTS = 8
"""``--invariance-requests`` default otherwise."""


def is_real(args) -> bool:
    """``args.model`` names real weights (a bundled model or a ``.gguf`` file)."""
    from attnplug.runner.models.gguf import is_gguf_model

    return is_gguf_model(args.model)


def resolve_defaults(args) -> str | None:
    """Fill the model-dependent defaults of ``args`` in place; returns why the flags do not
    go together (one line), or ``None``."""
    real = is_real(args)
    if getattr(args, "prompts", None) and not real:
        return "--prompts needs a real-weight model: --model smollm2 or --model PATH.gguf"
    if real and max(getattr(args, "tensor_parallel_size", 1), getattr(args, "pipeline_parallel_size", 1)) > 1:
        return ("real weights (GGUF) run in one process for now: drop --tensor-parallel-size / "
                "--pipeline-parallel-size, or use a preset (--model tiny-llama)")
    if args.num_requests is None and not (real and args.prompts):
        args.num_requests = REAL_NUM_REQUESTS if real else PRESET_NUM_REQUESTS
    if args.invariance_requests is None:
        args.invariance_requests = REAL_INVARIANCE_REQUESTS if real else PRESET_INVARIANCE_REQUESTS
    return None


def add_completions(summary: dict[str, Any], setup, results: dict) -> list[dict[str, Any]]:
    """With real weights: put the model's file and every request's prompt, completion and
    token ids (``text_requests.completions``) into ``summary`` (``--json``) and return them;
    else ``[]``."""
    tok = getattr(setup.model, "attnplug_tokenizer", None)
    if tok is None or not setup.texts:
        return []
    from attnplug.runner.commands.text_requests import completions

    items = completions(setup, results, tok)
    summary["model_weights"] = dict(getattr(setup.model, "attnplug_weights", {}))
    summary["completions"] = items
    return items


def print_completions(items: list[dict[str, Any]]) -> None:
    """The completions table (nothing without real weights)."""
    if items:
        from attnplug.runner.commands.text_requests import print_completions as show

        show(items)


__all__ = ["PRESET_INVARIANCE_REQUESTS", "PRESET_NUM_REQUESTS", "REAL_INVARIANCE_REQUESTS", "REAL_NUM_REQUESTS",
           "RUN_MODEL", "add_completions", "is_real", "print_completions", "resolve_defaults"]
