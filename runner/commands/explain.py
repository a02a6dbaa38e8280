"""``attnplug explain STEPS.jsonl [--check]``: print what the step compiler makes of each step.

The seed's "minimal reproducible experiment" as a tool. Input is JSON Lines:

* line 1: ``{"config": {"block_sizes": [4], "max_num_reqs": 8, "max_model_len": 64,
  "max_num_batched_tokens": 64}}`` — one block size per cache group; optional
  ``"kernel_block_sizes"``, ``"num_blocks"``, ``"group_kinds"``, ``"reorder_batch_threshold"``;
* every next line is one step: ``{"new": [{"req_id", "prompt_token_ids", "block_ids"
  (one list per group), "num_computed_tokens"}], "cached": [{"req_id", "new_token_ids",
  "new_block_ids", "num_computed_tokens", "resumed_from_preemption"}],
  "num_scheduled_tokens": {req_id: n}, "finished_req_ids": [...]}``.
  ``new_token_ids`` are tokens appended to the request since its last step (e.g. sampled
  outputs): ``explain`` does not sample. Omitted optional fields default to empty /
  ``null`` / ``false``; blank lines and lines starting with ``#`` are skipped.

Output: one JSON object per step with the keys of :data:`OUTPUT_KEYS` (``block_table`` is
per group, per row, the row's *kernel* block ids; ``slot_mapping`` is per group).
``--check`` runs ``attnplug.core.validate`` on every group each step.

A bad step prints ``attnplug explain: step N: ...`` (naming the field) on stderr and
exits 2; the steps before it were already printed. A broken invariant under ``--check``
exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterator, TextIO

from attnplug.core.errors import InvalidSchedulerOutput, MetadataInvariantError
from attnplug.runner.step.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from attnplug.runner.step.compiler import StepCompiler

OUTPUT_KEYS = ("req_ids", "num_scheduled_tokens", "num_computed_tokens", "query_start_loc", "positions",
               "input_ids", "seq_lens", "logits_indices", "discard", "slot_mapping", "block_table",
               "num_actual_tokens", "max_query_len", "max_seq_len")
"""The keys of every output line, in order."""

CONFIG_KEYS = {"block_sizes", "max_num_reqs", "max_model_len", "max_num_batched_tokens", "kernel_block_sizes",
               "num_blocks", "group_kinds", "reorder_batch_threshold"}


class StepFormatError(Exception):
    """A JSONL step that is not a well-formed scheduler output (field named)."""

    def __init__(self, field: str, message: str, req_id: str | None = None):
        self.field, self.req_id = field, req_id
        super().__init__(message)


def _get(obj: dict, key: str, kind: type | tuple, default: Any = ..., where: str = "", req_id=None):
    if key not in obj:
        if default is ...:
            raise StepFormatError(where + key, "missing", req_id)
        return default
    v = obj[key]
    if not isinstance(v, kind) or isinstance(v, bool) and kind in (int, (int,)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise StepFormatError(where + key, f"expected {names}, got {v!r}", req_id)
    return v


def parse_step(obj: Any) -> SchedulerOutput:
    """One JSON step object → :class:`SchedulerOutput`.

    Raises:
        StepFormatError: a missing or mistyped field.
    """
    if not isinstance(obj, dict):
        raise StepFormatError("step", f"expected a JSON object, got {obj!r}")
    unknown = set(obj) - {"new", "cached", "num_scheduled_tokens", "finished_req_ids"}
    if unknown:
        raise StepFormatError(sorted(unknown)[0], "unknown field")
    new = []
    for r in _get(obj, "new", list, []):
        if not isinstance(r, dict):
            raise StepFormatError("new", f"expected request objects, got {r!r}")
        rid = _get(r, "req_id", str, where="new.")
        sp = r.get("sampling_params", {})
        if not isinstance(sp, dict):
            raise StepFormatError("new.sampling_params", f"expected an object, got {sp!r}", rid)
        try:
            sampling = SamplingParams(**sp)
        except TypeError as e:
            raise StepFormatError("new.sampling_params", str(e), rid) from None
        new.append(NewRequestData(
            req_id=rid,
            prompt_token_ids=_get(r, "prompt_token_ids", list, where="new.", req_id=rid),
            block_ids=tuple(_get(r, "block_ids", list, where="new.", req_id=rid)),
            num_computed_tokens=_get(r, "num_computed_tokens", int, 0, "new.", rid),
            sampling_params=sampling,
            output_token_ids=_get(r, "output_token_ids", list, [], "new.", rid)))
    cached = CachedRequestData()
    for r in _get(obj, "cached", list, []):
        if not isinstance(r, dict):
            raise StepFormatError("cached", f"expected request objects, got {r!r}")
        rid = _get(r, "req_id", str, where="cached.")
        nb = _get(r, "new_block_ids", (list, type(None)), None, "cached.", rid)
        cached.req_ids.append(rid)
        cached.new_token_ids.append(_get(r, "new_token_ids", list, [], "cached.", rid))
        cached.new_block_ids.append(None if nb is None else tuple(nb))
        cached.num_computed_tokens.append(_get(r, "num_computed_tokens", int, where="cached.", req_id=rid))
        cached.resumed_from_preemption.append(_get(r, "resumed_from_preemption", bool, False, "cached.", rid))
    sched = _get(obj, "num_scheduled_tokens", dict)
    finished = _get(obj, "finished_req_ids", list, [])
    return SchedulerOutput(new, cached, dict(sched), finished_req_ids=set(finished))


def step_to_json(sc: StepCompiler, inputs) -> dict:
    """The output object of one step (plain lists)."""
    R, Q = inputs.num_reqs, inputs.num_actual_tokens
    tables = []
    for g, bt in enumerate(sc.input_batch.block_table):
        k = bt.kernel_blocks_per_block
        rows = bt.kernel_block_table.np
        tables.append([rows[i, :bt.num_blocks_per_row[i] * k].tolist() for i in range(R)])
    return {
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
    }


def _lines(f: TextIO) -> Iterator[tuple[int, str]]:
    for lineno, line in enumerate(f, 1):
        if line.strip() and not line.lstrip().startswith("#"):
            yield lineno, line


def make_compiler(config: Any, check: bool) -> StepCompiler:
    """A :class:`StepCompiler` from the config line's object.

    Raises:
        StepFormatError: a missing, unknown or mistyped config key.
    """
    if not isinstance(config, dict) or set(config) != {"config"} or not isinstance(config["config"], dict):
        raise StepFormatError("config", 'line 1 must be {"config": {...}}')
    cfg = dict(config["config"])
    unknown = set(cfg) - CONFIG_KEYS
    if unknown:
        raise StepFormatError(f"config.{sorted(unknown)[0]}", "unknown key")
    block_sizes = _get(cfg, "block_sizes", list, where="config.")
    try:
        return StepCompiler(
            block_sizes, _get(cfg, "max_num_reqs", int, where="config."),
            _get(cfg, "max_model_len", int, where="config."),
            _get(cfg, "max_num_batched_tokens", int, where="config."),
            kernel_block_sizes=cfg.get("kernel_block_sizes"),
            reorder_batch_threshold=cfg.get("reorder_batch_threshold"),
            num_blocks=cfg.get("num_blocks"), group_kinds=cfg.get("group_kinds"), validate=check)
    except (ValueError, TypeError) as e:
        raise StepFormatError("config", str(e)) from None


def run(f: TextIO, out: TextIO, err: TextIO, check: bool = False) -> int:
    """Explain every step of ``f``; return the exit status (0, 1 or 2)."""
    lines = _lines(f)
    first = next(lines, None)
    if first is None:
        print("attnplug explain: empty input: line 1 must be the config object", file=err)
        return 2
    try:
        sc = make_compiler(json.loads(first[1]), check)
    except json.JSONDecodeError as e:
        print(f"attnplug explain: config (line {first[0]}): not JSON: {e}", file=err)
        return 2
    except StepFormatError as e:
        print(f"attnplug explain: config (line {first[0]}): field {e.field!r}: {e}", file=err)
        return 2
    for step, (lineno, line) in enumerate(lines, 1):
        where = f"step {step} (line {lineno})"
        try:
            so = parse_step(json.loads(line))
            sc.update_states(so)
            inputs = sc.prepare_inputs(so)
        except json.JSONDecodeError as e:
            print(f"attnplug explain: {where}: not JSON: {e}", file=err)
            return 2
        except StepFormatError as e:
            who = f" of request {e.req_id!r}" if e.req_id else ""
            print(f"attnplug explain: {where}: field {e.field!r}{who}: {e}", file=err)
            return 2
        except InvalidSchedulerOutput as e:
            who = f" of request {e.req_id!r}" if e.req_id is not None else ""
            print(f"attnplug explain: {where}: field {e.field!r}{who}: {e}", file=err)
            return 2
        except MetadataInvariantError as e:
            print(f"attnplug explain: {where}: --check failed: {e}", file=err)
            return 1
        print(json.dumps(step_to_json(sc, inputs)), file=out, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``attnplug explain STEPS.jsonl [--check]`` (``-`` reads stdin)."""
    parser = argparse.ArgumentParser(prog="attnplug explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", help="JSON Lines file: a config line, then one step per line ('-': stdin)")
    parser.add_argument("--check", action="store_true", help="validate the eight invariants every step")
    args = parser.parse_args(argv)
    if args.steps == "-":
        return run(sys.stdin, sys.stdout, sys.stderr, args.check)
    try:
        with open(args.steps, encoding="utf-8") as f:
            return run(f, sys.stdout, sys.stderr, args.check)
    except OSError as e:
        print(f"attnplug explain: cannot read {args.steps!r}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
