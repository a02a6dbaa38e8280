"""Timed traces (Mooncake / ``vllm bench serve --dataset-name timed_trace`` JSONL): hash ids
become shared token blocks, timestamps (ms) become arrivals, and a bad line is one message
naming the line and the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnplug.core.errors import TraceFormatError
from attnplug.runner.commands.timed_trace import is_timed_trace, load_timed_trace


def write(tmp_path, lines) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def load(path, **kw):
    kw = {"max_model_len": 64, "vocab_size": 1000, "seed": 0, "chunk_size": 4, **kw}
    return load_timed_trace(path, None, **kw)


def test_hash_ids_are_shared_blocks_and_timestamps_are_milliseconds(tmp_path):
    path = write(tmp_path, [{"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [1, 2, 3]},
                            {"timestamp": 1250, "input_length": 6, "output_length": 2, "hash_ids": [1, 5]},
                            "",  # blank lines are not requests
                            {"timestamp": 3000, "input_length": 7, "output_length": 1, "hash_ids": [2],
                             "extra": "ignored"}])
    trace, prompts = load(path)
    assert [(r.prompt_len, r.output_len) for r in trace] == [(10, 3), (6, 2), (7, 1)]
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 0.25, 2.0])
    assert [len(p) for p in prompts] == [10, 6, 7]
    a, b, c = prompts
    assert a[:4] == b[:4]             # block 1 shared
    assert b[4:6] != a[4:6]           # blocks 5 and 2 differ
    assert c[:4] == a[4:8]            # block 2, wherever it stands
    # beyond its blocks, a prompt goes on with its own stream (request 2: default_rng([seed, 2]))
    assert c[4:] == np.random.default_rng([0, 2]).integers(0, 1000, size=7).tolist()[4:]
    # a last partial block is a prefix of the full block (request 0 takes 2 of block 3's 4 tokens)
    _, longer = load(write(tmp_path, [{"timestamp": 0, "input_length": 12, "output_length": 1,
                                       "hash_ids": [1, 2, 3]}]))
    assert longer[0][8:10] == a[8:10]


def test_first_n_lines_and_skip_invalid(tmp_path):
    lines = [{"timestamp": i, "input_length": 3, "output_length": 2} for i in range(5)]
    lines.insert(2, {"timestamp": 9, "input_length": 0, "output_length": 2})
    path = write(tmp_path, lines)
    trace, _ = load_timed_trace(path, 2, max_model_len=64, vocab_size=50)
    assert len(trace) == 2
    trace, _ = load(path, skip_invalid=True)
    assert len(trace) == 5 and trace.num_skipped == 1 and "line 3" in trace.first_skipped


@pytest.mark.parametrize("line,where", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"input_length": 3, "output_length": 2}, "field 'timestamp' is missing"),
    ({"timestamp": "soon", "input_length": 3, "output_length": 2}, "field 'timestamp'"),
    ({"timestamp": 0, "output_length": 2}, "field 'input_length' is missing"),
    ({"timestamp": 0, "input_length": "12", "output_length": 2}, "field 'input_length' must be an integer"),
    ({"timestamp": 0, "input_length": 3.0, "output_length": 2}, "field 'input_length' must be an integer"),
    ({"timestamp": 0, "input_length": 3, "output_length": 0}, "field 'output_length' must be in [1"),
    ({"timestamp": 0, "input_length": 3, "output_length": True}, "field 'output_length' must be an integer"),
    ({"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": [1, -1]}, "field 'hash_ids'"),
    ({"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": 7}, "field 'hash_ids'"),
    ({"timestamp": 0, "input_length": 60, "output_length": 10}, "longer than max_model_len=64"),
])
def test_a_bad_line_is_one_message_naming_line_and_field(tmp_path, line, where):
    path = write(tmp_path, [{"timestamp": 0, "input_length": 3, "output_length": 2}, line])
    with pytest.raises(TraceFormatError) as e:
        load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}, line 2: ") and where in msg, msg


def test_invalid_utf8_and_suffix(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"timestamp": 0, "input_length": 3, "output_length": 2, "x": "\xff"}\n')
    with pytest.raises(TraceFormatError, match="line 1: not valid UTF-8"):
        load(str(path))
    assert is_timed_trace("a/b.JSONL") and not is_timed_trace("conv") and not is_timed_trace("t.csv")
