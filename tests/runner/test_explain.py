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
