"""Requests from text for a real-weight model (``attnplug run --model smollm2``): prompts
tokenised through the model's chat template, output lengths and arrival order from the
trace, completions decoded for the table and ``--json``.

A timed-trace ``.jsonl`` (``timed_trace.py``) keeps its own prompt lengths and shared
hash ids: each id's block is a window of the tokenised prompt text.

Request ``i`` pairs prompt ``i`` (``text_prompts.load_prompts``; the bundled set repeated
when more requests are asked for than it holds) with trace row ``i``: its ``max_tokens``
is the prompt line's ``max_tokens`` if given, else the row's output length
(``traces.load_trace`` with ``scale=1``: the trace's own count, at most half of
``--max-model-len``; the row's prompt length is not used), cut so that prompt plus output fit
``--max-model-len``. Generation also stops at the model's EOS token (``<|im_end|>`` for
SmolLM2), which ends the reply as the chat template expects.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnplug.core.errors import TraceFormatError
from attnplug.runner.commands.text_prompts import TextPrompt, cycled, load_prompts

DEFAULT_SHOWN = 4
"""Completions the table shows."""


def add_text_requests(setup, args, tokenizer, max_model_len: int) -> None:
    """Fill ``setup.prompts`` / ``sampling_params`` / ``texts`` / ``trace_info`` from
    ``args.prompts`` (a JSONL path, or ``None``: the bundled set) and ``args.trace``.

    Raises:
        TraceFormatError: a bad prompts file or trace, or a prompt that does not leave
            room for one output token under ``max_model_len``.
    """
    from attnplug.runner.commands.serving_flags import sampling_params
    from attnplug.runner.commands.traces import BUNDLED_ATTRIBUTION, BUNDLED_TRACES, load_trace

    from attnplug.runner.commands.timed_trace import is_timed_trace

    if is_timed_trace(args.trace):  # its hash_ids are token blocks: windows of the prompt text
        return _add_timed_trace_requests(setup, args, tokenizer, max_model_len)
    path = getattr(args, "prompts", None)
    wanted = args.num_requests
    prompts = load_prompts(path, limit=wanted if path else None)
    if path is None:
        prompts = cycled(prompts, wanted)
    # the prompts are text, so the trace gives only output lengths: taken as they are (scale 1),
    # cut to half of max_model_len (clamp), not shrunk with the trace's prompt lengths
    trace = load_trace(args.trace, len(prompts), max_model_len=max_model_len, scale=1.0, clamp=True,
                       skip_invalid=args.skip_invalid)
    rows = list(trace) or [None]
    eos = tokenizer.eos_token_id
    for i, tp in enumerate(prompts):
        rid = f"req-{i}"
        ids = tokenizer.encode_chat(list(tp.messages))
        if len(ids) >= max_model_len:
            raise TraceFormatError(f"{path or 'the bundled prompts'}: request {i}{_label(tp)} has {len(ids)} prompt "
                                   f"tokens, at least --max-model-len {max_model_len}; raise --max-model-len")
        row = rows[i % len(rows)]
        want = tp.max_tokens or (row.output_len if row is not None else 64)
        setup.prompts[rid] = ids
        sp = sampling_params(args, i, want)  # --temperature / --top-p / --top-k / --output-len
        setup.sampling_params[rid] = dataclasses.replace(
            sp, max_tokens=max(1, min(sp.max_tokens, max_model_len - len(ids))),
            stop_token_ids=(eos,) if eos is not None else ())
        if row is not None:
            setup.trace_arrival_s[rid] = row.arrival_s
        setup.texts[rid] = {"id": tp.id or rid, "kind": tp.kind, "group": tp.group,
                            "prompt": tp.last_user_text, "messages": list(tp.messages)}
    setup.trace_info = {"source": args.trace, "requests": len(trace), "skipped_rows": trace.num_skipped,
                        "scale": trace.scale, "prompts": path or "bundled"}
    if args.trace in BUNDLED_TRACES:  # the licence (CC-BY 4.0) travels with what the data produced
        setup.trace_info["attribution"] = BUNDLED_ATTRIBUTION


def _add_timed_trace_requests(setup, args, tokenizer, max_model_len: int) -> None:
    """A timed-trace ``.jsonl`` on real weights: its lengths, arrivals and hash ids as for a
    preset (``timed_trace.py``), each hash id's block a window of the tokenised prompt text
    (the bundled prompts or ``--prompts``), so shared ids share text prefixes."""
    from attnplug.runner.commands.serving_flags import sampling_params
    from attnplug.runner.commands.timed_trace import load_timed_trace

    path = getattr(args, "prompts", None)
    text = "\n\n".join(m["content"] for tp in load_prompts(path) for m in tp.messages)
    trace, prompts = load_timed_trace(args.trace, args.num_requests, max_model_len=max_model_len,
                                      vocab_size=setup.model.config.vocab_size, seed=args.seed,
                                      chunk_size=getattr(args, "timed_trace_chunk_hash_size", 16),
                                      skip_invalid=args.skip_invalid, corpus=tokenizer.encode(text))
    eos = tokenizer.eos_token_id
    for i, (row, ids) in enumerate(zip(trace, prompts)):
        rid = f"req-{i}"
        setup.prompts[rid] = ids
        setup.sampling_params[rid] = dataclasses.replace(sampling_params(args, i, row.output_len),
                                                         stop_token_ids=(eos,) if eos is not None else ())
        setup.trace_arrival_s[rid] = row.arrival_s
        setup.texts[rid] = {"id": rid, "kind": "timed-trace", "group": None, "prompt": tokenizer.decode(ids),
                            "messages": []}
    setup.trace_info = {"source": args.trace, "requests": len(trace), "skipped_rows": trace.num_skipped,
                        "scale": 1.0, "prompts": f"windows of {path or 'the bundled prompts'}"}


def _label(tp: TextPrompt) -> str:
    return f" (id {tp.id!r})" if tp.id else ""


def completions(setup, results: dict, tokenizer) -> list[dict[str, Any]]:
    """Per request (id order): its labels, prompt text, completion text, prompt and output
    token ids and why it stopped (``"stop"``: the EOS token; ``"length"``: ``max_tokens``)."""
    out = []
    for rid in sorted(setup.texts, key=lambda r: int(r.split("-")[1])):
        res, meta = results[rid], setup.texts[rid]
        ids = list(map(int, res.output_token_ids))
        stops = setup.sampling_params[rid].stop_token_ids
        out.append({"request_id": rid, "id": meta["id"], "kind": meta["kind"], "group": meta["group"],
                    "prompt": meta["prompt"], "completion": tokenizer.decode(ids),
                    "finish_reason": "stop" if ids and ids[-1] in stops else "length",
                    "prompt_token_ids": list(map(int, res.prompt_token_ids)), "output_token_ids": ids})
    return out


def print_completions(items: list[dict[str, Any]], console=None, shown: int = DEFAULT_SHOWN) -> None:
    """A table of the first ``shown`` prompts and their completions."""
    from rich.table import Table

    from attnplug.runner.commands.report import Console

    console = console or Console()
    t = Table(title=f"completions (first {min(shown, len(items))} of {len(items)}; greedy)", show_lines=True)
    t.add_column("kind", no_wrap=True)
    t.add_column("prompt (last user turn)", ratio=2)
    t.add_column("completion", ratio=3)
    for item in items[:shown]:
        t.add_row(item["kind"] or "-", _cut(item["prompt"], 200), _cut(item["completion"], 400))
    console.print(t)


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


__all__ = ["DEFAULT_SHOWN", "add_text_requests", "completions", "print_completions"]
