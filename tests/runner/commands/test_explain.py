"""``attnplug explain``: output keys, --check, and one-line errors with exit status 2."""

from __future__ import annotations

import io
import json

import pytest

from attnplug.runner.commands import cli, explain as explain_mod
from attnplug.runner.commands.explain import OUTPUT_KEYS, main, run

CONFIG = {"config": {"block_sizes": [4], "max_num_reqs": 8, "max_model_len": 64, "max_num_batched_tokens": 64}}
STEP1 = {"new": [{"req_id": "A", "prompt_token_ids": [1, 2, 3], "block_ids": [[1]], "num_computed_tokens": 0}],
         "num_scheduled_tokens": {"A": 3}}
STEP2 = {"cached": [{"req_id": "A", "new_token_ids": [4], "new_block_ids": [[2]], "num_computed_tokens": 3,
                     "resumed_from_preemption": False}], "num_scheduled_tokens": {"A": 1}, "finished_req_ids": []}


def jsonl(*objs) -> str:
    return "\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n"


def explain(text: str, check: bool = False) -> tuple[int, list[dict], str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run(io.StringIO(text), out, err, check)
    return rc, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def test_one_object_per_step_with_the_issue_keys():
    rc, steps, err = explain(jsonl(CONFIG, STEP1, STEP2), check=True)
    assert rc == 0 and err == ""
    assert [tuple(s) for s in steps] == [OUTPUT_KEYS, OUTPUT_KEYS]
    assert steps[1]["positions"] == [3] and steps[1]["input_ids"] == [4]
    assert steps[1]["block_table"] == [[[1, 2]]] and steps[1]["slot_mapping"] == [[7]]


def test_main_reads_a_file_and_the_cli_dispatches_to_it(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    path.write_text(jsonl(CONFIG, "# a comment", "", STEP1))
    assert main([str(path), "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["query_start_loc"] == [0, 3]
    assert cli.main(["explain", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["seq_lens"] == [3]
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_bad_step_prints_earlier_steps_then_one_line_naming_step_and_field():
    bad = {"cached": [{"req_id": "A", "num_computed_tokens": 3}], "num_scheduled_tokens": {"A": 5}}
    rc, steps, err = explain(jsonl(CONFIG, STEP1, bad, STEP2))
    assert rc == 2
    assert len(steps) == 1  # step 1 was printed; nothing after the bad step
    assert err.count("\n") == 1
    assert "step 2" in err and "'num_scheduled_tokens'" in err and "'A'" in err


@pytest.mark.parametrize("step,field", [
    ({"num_scheduled_tokens": {"Z": 1}}, "num_scheduled_tokens"),
    ({"new": [{"req_id": "B", "prompt_token_ids": [1], "block_ids": [[0]]}], "num_scheduled_tokens": {"B": 1}},
     "block_ids"),
    ({"new": [{"req_id": "B", "prompt_token_ids": [1]}], "num_scheduled_tokens": {"B": 1}}, "new.block_ids"),
    ({"cached": [{"req_id": "A", "num_computed_tokens": "3"}], "num_scheduled_tokens": {"A": 1}},
     "cached.num_computed_tokens"),
    ({"num_scheduled_tokens": {}, "finished_req_ids": ["nobody"]}, "finished_req_ids"),
    ({"num_scheduled_tokens": {}, "extra": 1}, "extra"),
    ({"new": []}, "num_scheduled_tokens"),
])
def test_bad_fields_are_named(step, field):
    rc, steps, err = explain(jsonl(CONFIG, STEP1, step))
    assert rc == 2 and len(steps) == 1
    assert "step 2" in err and repr(field) in err, err


def test_not_json_and_bad_config():
    rc, steps, err = explain(jsonl(CONFIG, STEP1, "{not json"))
    assert rc == 2 and len(steps) == 1 and "step 2" in err and "not JSON" in err
    rc, _, err = explain(jsonl({"config": {"block_sizes": [4]}}, STEP1))
    assert rc == 2 and "config" in err and "max_num_reqs" in err
    rc, _, err = explain(jsonl({"config": {**CONFIG["config"], "block_sizes": [6], "kernel_block_sizes": [4]}}))
    assert rc == 2 and "not a multiple" in err
    rc, _, err = explain("")
    assert rc == 2 and "empty input" in err


def test_check_failure_exits_1(monkeypatch):
    from attnplug.core.errors import MetadataInvariantError

    def broken(*args, **kwargs):
        raise MetadataInvariantError("5 positions", 0, {"position": 7, "expected": 3})

    monkeypatch.setattr("attnplug.runner.step.compiler.validate", broken)
    rc, steps, err = explain(jsonl(CONFIG, STEP1), check=True)
    assert rc == 1 and steps == [] and "step 1" in err and "5 positions" in err
    assert explain_mod.OUTPUT_KEYS[0] == "req_ids"


def _one_line(rc, err, *what, status=2):
    assert rc == status and err.count("\n") == 1 and "Traceback" not in err, err[:500]
    for w in what:
        assert w in err, err[:500]


@pytest.mark.parametrize("key, value, what", [
    ("max_num_reqs", -1, "field 'config.max_num_reqs': expected an int in [1, 4096], got -1"),
    ("max_model_len", 10**15, "field 'config.max_model_len': expected an int in [1, 1048576], got 1000000000000000"),
    ("max_num_batched_tokens", 1e30, "field 'config.max_num_batched_tokens': expected an int in"),
    ("num_blocks", [0], "field 'config.num_blocks[0]': expected an int in [2, 2147483647], got 0"),
    ("num_blocks", 1e30, "field 'config.num_blocks'"),
    ("block_sizes", [[0]], "field 'config.block_sizes[0]'"),
    ("block_sizes", [1e30], "field 'config.block_sizes[0]'"),
    ("reorder_batch_threshold", "x", "field 'config.reorder_batch_threshold': expected an int in [1, 1048576]"),
    ("reorder_batch_threshold", 1.5, "field 'config.reorder_batch_threshold'"),
    ("kernel_block_sizes", 5, "field 'config.kernel_block_sizes': expected a list of 1 (one per cache group)"),
    ("group_kinds", [[0]], "field 'config.group_kinds'"),
])
def test_bad_config_values_are_one_line(key, value, what):
    rc, steps, err = explain(jsonl({"config": {**CONFIG["config"], key: value}}, STEP1))
    _one_line(rc, err, "config (line 1): ", what)
    assert steps == []


def test_config_tables_are_bounded():
    cfg = {**CONFIG["config"], "max_num_reqs": 4096, "max_model_len": 2**20}
    rc, _, err = explain(jsonl({"config": cfg}, STEP1))
    _one_line(rc, err, "field 'config.max_num_reqs': max_num_reqs 4096 x max_model_len 1048576", "more than 67108864")


BIG = "9" * 5000


@pytest.mark.parametrize("line, what", [
    ('{"num_scheduled_tokens": {"A": "x"}}', "field 'num_scheduled_tokens' of request 'A': expected an int count, got 'x'"),
    ('{"num_scheduled_tokens": {"A": true}}', "field 'num_scheduled_tokens' of request 'A': expected an int count"),
    ('{"num_scheduled_tokens": {}, "finished_req_ids": [[1]]}', "field 'finished_req_ids': expected request ids"),
    ('{"num_scheduled_tokens": {}, "finished_req_ids": [{"a": 1}]}', "field 'finished_req_ids'"),
    ('{"num_scheduled_tokens": {"A": ' + BIG + '}}', "got <an integer of 5000 digits, outside int64>"),
    ('{"cached": [{"req_id": "A", "num_computed_tokens": -' + BIG + '}], "num_scheduled_tokens": {"A": 1}}',
     "field 'cached.num_computed_tokens' of request 'A': expected int, got <an integer of 5000 digits"),
    ('{"new": [{"req_id": "B", "prompt_token_ids": [1e400], "block_ids": [[2]]}], "num_scheduled_tokens": {"B": 1}}',
     "field 'new.prompt_token_ids' of request 'B': entry 0: expected int, got inf"),
    ('{"new": [{"req_id": "B", "prompt_token_ids": [1], "block_ids": [["2"]]}], "num_scheduled_tokens": {"B": 1}}',
     "field 'new.block_ids' of request 'B': entry 0: expected int, got '2'"),
    ('{"new": [{"req_id": "B", "prompt_token_ids": [1], "block_ids": [[2]], "x": 1}], "num_scheduled_tokens": {}}',
     "field 'new.x' of request 'B': unknown field"),
    ('{"num_scheduled_tokens": {"A": NaN}}', "not JSON: NaN is not JSON"),
    ("[" * 100_000 + "]" * 100_000, "not JSON this parser can read: nested too deeply"),
])
def test_bad_step_values_are_one_line(line, what):
    rc, steps, err = explain(jsonl(CONFIG, STEP1, line))
    _one_line(rc, err, "step 2 (line 3): ", what)
    assert len(steps) == 1


def test_invalid_utf8_and_long_lines_name_the_line(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    data = jsonl(CONFIG, STEP1).encode() + b'{"num_scheduled_tokens": {"\xff": 1}}\n'
    _one_line(run(io.BytesIO(data), out, err), err.getvalue(),
              "step 2 (line 3): not valid UTF-8: byte 0xff at column 28")
    monkeypatch.setattr("attnplug.runner.commands.explain_input.MAX_LINE_BYTES", 1000)
    out, err = io.StringIO(), io.StringIO()
    data = jsonl(CONFIG, STEP1).encode() + b" " * 5000 + b"{}\n" + jsonl(STEP2).encode()
    _one_line(run(io.BytesIO(data), out, err), err.getvalue(), "step 2 (line 3): longer than 1000 bytes")


def test_a_huge_id_is_not_echoed_whole():
    rid = "x" * 2_000_000
    rc, _, err = explain(jsonl(CONFIG, STEP1, {"num_scheduled_tokens": {rid: 1}}))
    _one_line(rc, err, "field 'num_scheduled_tokens': request id 'xxx", "... (2000000 chars) is longer than 1024")
    assert len(err) < 300
    rc, _, err = explain(jsonl(CONFIG, STEP1, {"num_scheduled_tokens": {"y" * 1000: 1}}))
    _one_line(rc, err, "request 'yyy", "(1000 chars)")  # the compiler's own message, cut
    assert len(err) < 1100


def test_a_closed_pipe_ends_quietly_like_a_unix_filter(tmp_path):
    """``attnplug explain steps.jsonl | head -0``: no traceback, exit status 128 + SIGPIPE."""
    import subprocess
    import sys

    path = tmp_path / "steps.jsonl"
    path.write_text(jsonl(CONFIG, STEP1, STEP2))
    proc = subprocess.Popen([sys.executable, "-m", "attnplug", "explain", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == cli.EXIT_BROKEN_PIPE == 141 and err == "", err[-2000:]
