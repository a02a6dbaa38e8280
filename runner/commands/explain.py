"""``attnplug explain STEPS.jsonl [--check] [--svg F] [--html F]``: what the step compiler makes of each step.

The seed's "minimal reproducible experiment" as a tool. Input is JSON Lines:

* line 1: ``{"config": {"block_sizes": [4], "max_num_reqs": 8, "max_model_len": 64,
  "max_num_batched_tokens": 64}}`` — one block size per cache group; optional
  ``"kernel_block_sizes"``, ``"num_blocks"``, ``"group_kinds"``, ``"sliding_windows"`` (one int
  or ``null`` per group), ``"reorder_batch_threshold"``;
* every next line is one step: ``{"new": [{"req_id", "prompt_token_ids", "block_ids"
  (one list per group), "num_computed_tokens"}], "cached": [{"req_id", "new_token_ids",
  "new_block_ids", "num_computed_tokens", "resumed_from_preemption"}],
  "num_scheduled_tokens": {req_id: n}, "finished_req_ids": [...], "spec_token_ids": {req_id:
  [draft ids]}}`` (``spec_token_ids``: speculative decoding, the drafts a decoding request
  verifies this step, scheduled ``1 + len`` tokens; the compiler's
  ``scheduled_spec_decode_tokens``).
  ``new_token_ids`` are tokens appended to the request since its last step (e.g. sampled
  outputs): ``explain`` does not sample. Omitted optional fields default to empty /
  ``null`` / ``false``; blank lines and lines starting with ``#`` are skipped.

Output: one JSON object per step with the keys of :data:`OUTPUT_KEYS` (``block_table`` is
per group, per row, the row's *kernel* block ids; ``slot_mapping`` is per group;
``common_prefix_len`` is per group the tokens whose blocks are the same physical blocks in
every row, as the runner computes it for cascade attention, ``runner/execute/cascade.py``:
0 for sliding-window and Mamba groups). New requests may start at
``num_computed_tokens > 0`` on block ids other requests hold (prefix-cache hits);
prompt embeddings and M-RoPE add ``is_embed`` / ``mrope_positions``
(``runner/commands/explain_embeds.py``, which documents their input fields);
a step with drafts adds ``spec_decode``, its ``SpecDecodeMetadata``:
``num_draft_tokens``, ``cu_num_draft_tokens``, ``draft_token_ids``,
``target_logits_indices``, ``bonus_logits_indices``, ``logits_indices``, over the rows
whose logits are kept).
``--check`` runs ``attnplug.core.validate`` on every group each step. ``--svg`` / ``--html``
also draw every step (``runner/commands/explain_svg.py``).

A bad line prints one line ``attnplug explain: step N (line L): field F ...`` on stderr
and exits 2, whatever the bytes (the limits and the format: ``docs/configuration.md``,
"Limits on flags and files"); the steps before it were already printed. A broken
invariant under ``--check`` exits 1.
"""

from __future__ import annotations

import json
import sys
from typing import Any, BinaryIO, Callable, TextIO

from attnplug.core.errors import InvalidSchedulerOutput, KVCacheSpecError, MetadataInvariantError
from attnplug.runner.commands.explain_input import (
    StepFormatError,
    block_lists,
    config_args,
    counts,
    get,
    id_list,
    int_list,
    parse_json,
    read_lines,
    req_id_of,
    spec_tokens,
)
from attnplug.runner.commands.explain_embeds import embeds_json, placeholders_of, prompt_embeds_of
from attnplug.runner.commands.explain_svg import Pictures
from attnplug.runner.commands.limits import OneLineParser, clip
from attnplug.runner.execute.cascade import step_prefix_lens
from attnplug.runner.step.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from attnplug.runner.step.compiler import StepCompiler

OUTPUT_KEYS = ("req_ids", "num_scheduled_tokens", "num_computed_tokens", "query_start_loc", "positions",
               "input_ids", "seq_lens", "logits_indices", "discard", "slot_mapping", "block_table",
               "num_actual_tokens", "max_query_len", "max_seq_len", "common_prefix_len")
"""The keys of every output line, in order (a step with drafts adds ``spec_decode`` last)."""

MAX_ERROR_CHARS = 1000
"""An error line is cut to this many characters (echoed values are cut shorter still)."""


def _sampling(r: dict, rid: str) -> SamplingParams:
    sp = get(r, "sampling_params", dict, {}, "new.", rid)
    try:
        return SamplingParams(**sp)
    except TypeError as e:
        raise StepFormatError("new.sampling_params", clip(str(e), 200), rid) from None


def parse_step(obj: Any) -> SchedulerOutput:
    """One JSON step object → :class:`SchedulerOutput`, every field typed
    (``runner/commands/explain_input.py``); values are checked by the step compiler.

    Raises:
        StepFormatError: a missing, unknown or mistyped field.
    """
    if not isinstance(obj, dict):
        raise StepFormatError("step", f"expected a JSON object, got {clip(obj)}")
    unknown = set(obj) - {"new", "cached", "num_scheduled_tokens", "finished_req_ids", "spec_token_ids"}
    if unknown:
        raise StepFormatError(clip(sorted(unknown)[0], 40).strip("'"), "unknown field")
    new = []
    for r in get(obj, "new", list, []):
        rid = req_id_of(r, "new.")
        new.append(NewRequestData(
            req_id=rid,
            prompt_token_ids=int_list(r, "prompt_token_ids", "new.", rid),
            block_ids=block_lists(r, "block_ids", "new.", rid),
            num_computed_tokens=get(r, "num_computed_tokens", int, 0, "new.", rid),
            sampling_params=_sampling(r, rid),
            output_token_ids=int_list(r, "output_token_ids", "new.", rid, []),
            prompt_embeds=prompt_embeds_of(r, rid), mm_placeholders=placeholders_of(r, rid)))
    cached = CachedRequestData()
    for r in get(obj, "cached", list, []):
        rid = req_id_of(r, "cached.")
        cached.req_ids.append(rid)
        cached.new_token_ids.append(int_list(r, "new_token_ids", "cached.", rid, []))
        cached.new_block_ids.append(block_lists(r, "new_block_ids", "cached.", rid, None))
        cached.num_computed_tokens.append(get(r, "num_computed_tokens", int, where="cached.", req_id=rid))
        cached.resumed_from_preemption.append(get(r, "resumed_from_preemption", bool, False, "cached.", rid))
    sched = counts(obj)
    finished = id_list(obj, "finished_req_ids")
    return SchedulerOutput(new, cached, sched, finished_req_ids=set(finished),
                           scheduled_spec_decode_tokens=spec_tokens(obj))


def step_to_json(sc: StepCompiler, inputs) -> dict:
    """The output object of one step (plain lists)."""
    R, Q = inputs.num_reqs, inputs.num_actual_tokens
    tables = []
    for g, bt in enumerate(sc.input_batch.block_table):
        k = bt.kernel_blocks_per_block
        rows = bt.kernel_block_table.np
        tables.append([rows[i, :bt.num_blocks_per_row[i] * k].tolist() for i in range(R)])
    out = {
        "req_ids": list(inputs.req_ids),
        "num_scheduled_tokens": inputs.num_scheduled_tokens.tolist(),
        "num_computed_tokens": inputs.num_computed_tokens.tolist(),
        "query_start_loc": inputs.query_start_loc_cpu.tolist(),
        "positions": inputs.positions_cpu[:Q].tolist(),
        "input_ids": inputs.input_ids.cpu()[:Q].tolist(),
        "seq_lens": inputs.seq_lens_cpu.tolist(),
        "logits_indices": inputs.logits_indices_cpu.tolist(),
        "discard": inputs.discard.tolist(),
        "slot_mapping": [sm.cpu()[:Q].tolist() for sm in inputs.slot_mapping],
        "block_table": tables,
        "num_actual_tokens": Q,
        "max_query_len": inputs.max_query_len,
        "max_seq_len": inputs.max_seq_len,
        "common_prefix_len": step_prefix_lens(sc, inputs.common_attn_metadata,
                                              [k != "full_attention" for k in sc.layout.group_kinds]),
    }
    out.update(embeds_json(inputs))  # "is_embed", "mrope_positions" (runner/commands/explain_embeds.py)
    if inputs.spec_decode_metadata is not None:
        out["spec_decode"] = _spec_json(inputs.spec_decode_metadata)
    return out


def _spec_json(md) -> dict:
    return {"num_draft_tokens": list(md.num_draft_tokens), "cu_num_draft_tokens": md.cu_num_draft_tokens.tolist(),
            "draft_token_ids": md.draft_token_ids.tolist(), "target_logits_indices": md.target_logits_indices.tolist(),
            "bonus_logits_indices": md.bonus_logits_indices.tolist(), "logits_indices": md.logits_indices.tolist()}


def make_compiler(config: Any, check: bool) -> StepCompiler:
    """A :class:`StepCompiler` from the config line's object (checked by
    ``explain_input.config_args``).

    Raises:
        StepFormatError: a missing, unknown, mistyped or out-of-range config key.
    """
    try:
        return StepCompiler(**config_args(config), validate=check)
    except (KVCacheSpecError, ValueError) as e:
        raise StepFormatError("config", clip(str(e), 300)) from None


def _say(err: TextIO, text: str) -> None:
    """One line on ``err``: newlines escaped, cut to :data:`MAX_ERROR_CHARS`."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    if len(text) > MAX_ERROR_CHARS:
        text = f"{text[:MAX_ERROR_CHARS]}... ({len(text)} chars)"
    print(text, file=err)


def _field(e: StepFormatError | InvalidSchedulerOutput) -> str:
    if e.field == "line":  # the line itself: too long, not UTF-8, not JSON
        return str(e)
    who = f" of request {clip(e.req_id)}" if e.req_id is not None else ""
    return f"field {clip(e.field)}{who}: {e}"


def run(f: TextIO | BinaryIO, out: TextIO, err: TextIO, check: bool = False,
        on_step: Callable[[StepCompiler, dict], None] | None = None) -> int:
    """Explain every step of ``f`` (a text or binary stream); return the exit status
    (0; 1: a broken invariant under ``check``; 2: a bad line, named on one line of ``err``).
    ``on_step(compiler, output object)`` sees every step printed (``--svg`` / ``--html``)."""
    lines = read_lines(f)
    first = next(lines, None)
    if first is None:
        _say(err, "attnplug explain: empty input: line 1 must be the config object")
        return 2
    try:
        if isinstance(first[1], StepFormatError):
            raise first[1]
        sc = make_compiler(parse_json(first[1]), check)
    except StepFormatError as e:
        _say(err, f"attnplug explain: config (line {first[0]}): {_field(e)}")
        return 2
    for step, (lineno, line) in enumerate(lines, 1):
        where = f"step {step} (line {lineno})"
        try:
            if isinstance(line, StepFormatError):
                raise line
            so = parse_step(parse_json(line))
            sc.update_states(so)
            inputs = sc.prepare_inputs(so)
        except (StepFormatError, InvalidSchedulerOutput) as e:
            _say(err, f"attnplug explain: {where}: {_field(e)}")
            return 2
        except MetadataInvariantError as e:
            _say(err, f"attnplug explain: {where}: --check failed: {e}")
            return 1
        result = step_to_json(sc, inputs)
        if on_step is not None:
            on_step(sc, result)
        print(json.dumps(result), file=out, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``attnplug explain STEPS.jsonl [--check]`` (``-`` reads stdin)."""
    parser = OneLineParser(prog="attnplug explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", help="JSON Lines file: a config line, then one step per line ('-': stdin)")
    parser.add_argument("--check", action="store_true", help="validate the eight invariants every step")
    parser.add_argument("--svg", metavar="OUT.svg", help="also draw every step into one SVG file")
    parser.add_argument("--html", metavar="OUT.html", help="also write an HTML page: a legend, one SVG per step")
    args = parser.parse_args(argv)
    pics = Pictures() if args.svg or args.html else None
    on_step = pics.on_step if pics else None
    if args.steps == "-":
        rc = run(sys.stdin.buffer, sys.stdout, sys.stderr, args.check, on_step)
    else:
        try:
            f = open(args.steps, "rb")
        except OSError as e:
            print(f"attnplug explain: cannot read {clip(args.steps)}: {e.strerror}", file=sys.stderr)
            return 2
        with f:
            rc = run(f, sys.stdout, sys.stderr, args.check, on_step)
    if pics is not None:  # the steps explained so far, even when a later one failed
        try:
            pics.write(args.svg, args.html, f"attnplug explain {args.steps}")
        except OSError as e:
            print(f"attnplug explain: cannot write {clip(e.filename)}: {e.strerror}", file=sys.stderr)
            return 2
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
