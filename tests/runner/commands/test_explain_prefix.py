"""`attnplug explain` with prefix-cache hits: a new request starting at num_computed_tokens > 0
on blocks another request holds, ``common_prefix_len`` per group, and a hit whose visible
block is the null block refused on one line (exit 2)."""

from __future__ import annotations

import io
import json

from attnplug.runner.commands.explain import run

CONFIG = {"config": {"block_sizes": [4, 4], "max_num_reqs": 4, "max_model_len": 32, "max_num_batched_tokens": 32,
                     "group_kinds": ["full_attention", "sliding_window"], "sliding_windows": [None, 5]}}
A = {"new": [{"req_id": "a", "prompt_token_ids": list(range(1, 11)), "block_ids": [[1, 2, 3], [1, 2, 3]]}],
     "num_scheduled_tokens": {"a": 10}}


def _explain(*steps):
    out, err = io.StringIO(), io.StringIO()
    rc = run(io.StringIO("\n".join(json.dumps(s) for s in (CONFIG, *steps))), out, err, check=True)
    return rc, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def test_shared_blocks_and_a_hit_print_common_prefix_len():
    hit = {"new": [{"req_id": "b", "prompt_token_ids": list(range(1, 9)) + [20, 21],
                    "block_ids": [[1, 2, 4], [0, 2, 4]], "num_computed_tokens": 8}],
           "cached": [{"req_id": "a", "new_token_ids": [11], "num_computed_tokens": 10}],
           "num_scheduled_tokens": {"a": 1, "b": 2}}
    rc, steps, err = _explain(A, hit)
    assert rc == 0, err
    assert steps[0]["common_prefix_len"] == [0, 0]  # one row: nothing to share with
    last = steps[1]
    assert last["req_ids"] == ["a", "b"] and last["positions"] == [10, 8, 9]
    assert last["block_table"][0] == [[1, 2, 3], [1, 2, 4]]
    assert last["common_prefix_len"] == [8, 0]  # full group: blocks 1, 2 shared; window group: never


def test_a_hit_whose_window_block_is_null_is_refused():
    bad = {"new": [{"req_id": "b", "prompt_token_ids": list(range(1, 9)) + [20, 21],
                    "block_ids": [[1, 2, 4], [0, 0, 4]], "num_computed_tokens": 8}],
           "num_scheduled_tokens": {"b": 2}}
    rc, steps, err = _explain(A, bad)
    assert rc == 2 and len(steps) == 1
    assert "step 2" in err and "field 'block_ids' of request 'b'" in err and "null block" in err
