"""Reading ``attnplug explain``'s JSON Lines: bounded lines, strict JSON, typed and bounded
fields (the format is in ``runner/commands/explain.py``'s docstring; the limits in
``docs/configuration.md``, "explain JSONL").

Every problem is a :class:`StepFormatError` naming the field (and the request, when there
is one); nothing here raises anything else, whatever the bytes: invalid UTF-8, a line over
:data:`MAX_LINE_BYTES`, NaN / Infinity, integers outside ``int64``, nesting deeper than
the parser allows, wrong types, ids over :data:`MAX_ID_CHARS`, config values out of
:data:`CONFIG_LIMITS`.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import torch

from attnplug.runner.commands.limits import clip
from attnplug.runner.step.prompt_embeds import PromptEmbedsConfig

MAX_LINE_BYTES = 16 * 2**20
"""A line longer than this (bytes) is refused without being parsed."""

MAX_ID_CHARS = 1024
"""Longest request id accepted."""

CONFIG_LIMITS: dict[str, tuple[int, int]] = {
    "block_sizes": (1, 2**16), "kernel_block_sizes": (1, 2**16), "max_num_reqs": (1, 4096),
    "max_model_len": (1, 2**20), "max_num_batched_tokens": (1, 2**20), "num_blocks": (2, 2**31 - 1),
    "reorder_batch_threshold": (1, 2**20), "sliding_windows": (1, 2**20), "prompt_embeds_hidden_size": (1, 2**16),
}
"""``key -> (lowest, highest)`` of the config line's integers (each entry of a list too)."""

MAX_GROUPS = 16
"""Most cache groups (entries of ``block_sizes``)."""

MAX_TABLE_CELLS = 2**26
"""Most cells of the token table (``max_num_reqs * max_model_len``) and of the block tables
(``max_num_reqs * sum over groups of ceil(max_model_len / kernel_block_size)``): 256 MiB
of ``int32`` each, allocated when the compiler is made."""

CONFIG_KEYS = {"block_sizes", "max_num_reqs", "max_model_len", "max_num_batched_tokens", "kernel_block_sizes",
               "num_blocks", "group_kinds", "reorder_batch_threshold", "sliding_windows", "prompt_embeds_hidden_size",
               "uses_mrope"}
STEP_KEYS = {"new", "cached", "num_scheduled_tokens", "finished_req_ids", "spec_token_ids"}
NEW_KEYS = {"req_id", "prompt_token_ids", "block_ids", "num_computed_tokens", "sampling_params",
            "output_token_ids", "prompt_embeds", "mm_placeholders"}
CACHED_KEYS = {"req_id", "new_token_ids", "new_block_ids", "num_computed_tokens", "resumed_from_preemption"}


class StepFormatError(Exception):
    """A JSONL line that is not a well-formed config or step (field named).

    Attributes:
        field: the field at fault, e.g. ``"new.block_ids"`` or ``"config.max_num_reqs"``.
        req_id: the request concerned (``None`` when none).
    """

    def __init__(self, field: str, message: str, req_id: str | None = None):
        self.field, self.req_id = field, req_id
        super().__init__(message)


class BigInt:
    """An integer literal outside ``int64`` (never converted: a 5,000-digit literal stays text)."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits, outside int64>"


def _parse_int(text: str) -> int | BigInt:
    if len(text) > 20:
        return BigInt(text)
    value = int(text)
    return value if -2**63 <= value < 2**63 else BigInt(text)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def read_lines(f) -> Iterator[tuple[int, str | StepFormatError]]:
    """``(line number, text)`` of every line that is neither blank nor a ``#`` comment;
    a line over :data:`MAX_LINE_BYTES` or not valid UTF-8 comes as a :class:`StepFormatError`
    instead of its text. ``f`` is a binary or text stream."""
    lineno = 0
    while line := f.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(line) > MAX_LINE_BYTES and line[-1:] not in ("\n", b"\n"):
            while (more := f.readline(MAX_LINE_BYTES)) and more[-1:] not in ("\n", b"\n"):
                pass
            yield lineno, StepFormatError("line", f"longer than {MAX_LINE_BYTES} bytes")
            continue
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, StepFormatError("line", f"not valid UTF-8: byte 0x{line[e.start]:02x} at "
                                                      f"column {e.start + 1}")
                continue
        if line.strip() and not line.lstrip().startswith("#"):
            yield lineno, line


def parse_json(text: str) -> Any:
    """One line's JSON value; ints outside ``int64`` become :class:`BigInt`.

    Raises:
        StepFormatError: not JSON (NaN / Infinity included), or nested too deeply.
    """
    try:
        return json.loads(text, parse_int=_parse_int, parse_constant=_no_constant)
    except RecursionError:
        raise StepFormatError("line", "not JSON this parser can read: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError included
        raise StepFormatError("line", f"not JSON: {e}") from None


def _type_name(kind) -> str:
    return kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)


def get(obj: dict, key: str, kind: type | tuple, default: Any = ..., where: str = "", req_id=None):
    """``obj[key]`` if it has type ``kind`` (``bool`` is not an ``int``); ``default`` when
    absent (required when no default). Raises :class:`StepFormatError` naming ``where + key``."""
    if key not in obj:
        if default is ...:
            raise StepFormatError(where + key, "missing", req_id)
        return default
    v = obj[key]
    if not isinstance(v, kind) or isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise StepFormatError(where + key, f"expected {_type_name(kind)}, got {clip(v)}", req_id)
    return v


def int_list(obj: dict, key: str, where: str, req_id, default: Any = ...) -> list[int]:
    """``obj[key]`` as a list of ints (not bools) in ``int64``."""
    v = get(obj, key, list, default, where, req_id)
    for i, x in enumerate(v):
        if not isinstance(x, int) or isinstance(x, bool):
            raise StepFormatError(f"{where}{key}", f"entry {i}: expected int, got {clip(x)}", req_id)
    return v


def block_lists(obj: dict, key: str, where: str, req_id, default: Any = ...) -> tuple[list[int], ...] | None:
    """``obj[key]`` as one list of block ids per group (``None`` allowed when ``default`` is)."""
    v = get(obj, key, list if default is ... else (list, type(None)), default, where, req_id)
    if v is None:
        return None
    for g, ids in enumerate(v):
        if not isinstance(ids, list):
            raise StepFormatError(f"{where}{key}", f"group {g}: expected a list of block ids, got {clip(ids)}",
                                  req_id)
        int_list({key: ids}, key, where, req_id)
    return tuple(v)


def req_id_of(r: Any, where: str) -> str:
    """The ``req_id`` of request object ``r`` (a str of at most :data:`MAX_ID_CHARS`)."""
    if not isinstance(r, dict):
        raise StepFormatError(where.rstrip("."), f"expected request objects, got {clip(r)}")
    rid = get(r, "req_id", str, where=where)
    if len(rid) > MAX_ID_CHARS:
        raise StepFormatError(where + "req_id", f"{clip(rid)} is longer than {MAX_ID_CHARS} characters")
    unknown = set(r) - (NEW_KEYS if where == "new." else CACHED_KEYS)
    if unknown:
        raise StepFormatError(where + clip(sorted(unknown)[0], 40).strip("'"), "unknown field", rid)
    return rid


def id_list(obj: dict, key: str) -> list[str]:
    """``obj[key]`` as a list of request ids (str, at most :data:`MAX_ID_CHARS`)."""
    v = get(obj, key, list, [])
    for x in v:
        if not isinstance(x, str) or len(x) > MAX_ID_CHARS:
            raise StepFormatError(key, f"expected request ids (str of at most {MAX_ID_CHARS} chars), "
                                       f"got {clip(x)}")
    return v


def spec_tokens(obj: dict) -> dict[str, list[int]]:
    """``spec_token_ids``: request id -> its draft token ids (``scheduled_spec_decode_tokens``;
    values checked by the step compiler)."""
    v = get(obj, "spec_token_ids", dict, {})
    for rid in v:
        if len(rid) > MAX_ID_CHARS:
            raise StepFormatError("spec_token_ids", f"request id {clip(rid)} is longer than "
                                                    f"{MAX_ID_CHARS} characters")
        int_list(v, rid, "spec_token_ids.", rid)
    return dict(v)


def counts(obj: dict) -> dict[str, int]:
    """``num_scheduled_tokens``: request id -> int (range checked by the step compiler)."""
    v = get(obj, "num_scheduled_tokens", dict)
    for rid, n in v.items():
        if len(rid) > MAX_ID_CHARS:
            raise StepFormatError("num_scheduled_tokens", f"request id {clip(rid)} is longer than "
                                                          f"{MAX_ID_CHARS} characters")
        if not isinstance(n, int) or isinstance(n, bool):
            raise StepFormatError("num_scheduled_tokens", f"expected an int count, got {clip(n)}", rid)
    return dict(v)


def _bounded(cfg: dict, key: str, value: Any, index: int | None = None) -> int:
    low, high = CONFIG_LIMITS[key]
    at = "" if index is None else f"[{index}]"
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise StepFormatError(f"config.{key}{at}", f"expected an int in [{low}, {high}], got {clip(value)}")
    return value


def _per_group(cfg: dict, key: str, groups: int | None) -> list | None:
    v = cfg.get(key)
    if v is None and groups is not None:
        return None
    if not isinstance(v, list) or (groups is not None and len(v) != groups) or not 1 <= len(v) <= MAX_GROUPS:
        want = f"{groups} (one per cache group)" if groups is not None else f"1 to {MAX_GROUPS}"
        raise StepFormatError(f"config.{key}", f"expected a list of {want} entries, got {clip(v)}")
    return v


def config_args(config: Any) -> dict[str, Any]:
    """The ``StepCompiler`` keyword arguments of the config line's object, each checked
    against :data:`CONFIG_LIMITS` and the table sizes against :data:`MAX_TABLE_CELLS`.

    Raises:
        StepFormatError: a missing, unknown, mistyped or out-of-range key (named).
    """
    if not isinstance(config, dict) or set(config) != {"config"} or not isinstance(config["config"], dict):
        raise StepFormatError("config", 'line 1 must be {"config": {...}}')
    cfg = config["config"]
    unknown = set(cfg) - CONFIG_KEYS
    if unknown:
        raise StepFormatError(f"config.{clip(sorted(unknown)[0], 40)}", "unknown key")
    for key in ("block_sizes", "max_num_reqs", "max_model_len", "max_num_batched_tokens"):
        if key not in cfg:
            raise StepFormatError(f"config.{key}", "missing")
    sizes = [_bounded(cfg, "block_sizes", b, i) for i, b in enumerate(_per_group(cfg, "block_sizes", None))]
    G = len(sizes)
    kernel = _per_group(cfg, "kernel_block_sizes", G)
    kernel = None if kernel is None else [_bounded(cfg, "kernel_block_sizes", k, i) for i, k in enumerate(kernel)]
    out = {k: _bounded(cfg, k, cfg[k]) for k in ("max_num_reqs", "max_model_len", "max_num_batched_tokens")}
    pools = cfg.get("num_blocks")
    if isinstance(pools, list):
        pools = [_bounded(cfg, "num_blocks", n, i) for i, n in enumerate(_per_group(cfg, "num_blocks", G))]
    elif pools is not None:
        pools = _bounded(cfg, "num_blocks", pools)
    kinds = _per_group(cfg, "group_kinds", G)
    if kinds is not None and not all(isinstance(k, str) for k in kinds):
        raise StepFormatError("config.group_kinds", f"expected a list of kind names, got {clip(kinds)}")
    windows = _per_group(cfg, "sliding_windows", G)
    if windows is not None:  # null for a group without a window; kinds are matched by the layout
        windows = [None if w is None else _bounded(cfg, "sliding_windows", w, i) for i, w in enumerate(windows)]
    threshold = cfg.get("reorder_batch_threshold")
    if threshold is not None:
        _bounded(cfg, "reorder_batch_threshold", threshold)
    rows, width = out["max_num_reqs"], out["max_model_len"]
    block_cells = rows * sum(-(-width // k) for k in (kernel or sizes))
    if max(rows * width, block_cells) > MAX_TABLE_CELLS:
        raise StepFormatError("config.max_num_reqs", f"max_num_reqs {rows} x max_model_len {width} needs tables of "
                                                     f"{max(rows * width, block_cells)} cells, more than "
                                                     f"{MAX_TABLE_CELLS}; lower one of them")
    hidden = cfg.get("prompt_embeds_hidden_size")
    embeds = None if hidden is None else PromptEmbedsConfig(_bounded(cfg, "prompt_embeds_hidden_size", hidden),
                                                            torch.float32)
    return dict(block_sizes=sizes, **out, kernel_block_sizes=kernel, num_blocks=pools, group_kinds=kinds,
                reorder_batch_threshold=threshold, sliding_windows=windows, prompt_embeds=embeds,
                uses_mrope=get(cfg, "uses_mrope", bool, False, "config."))
