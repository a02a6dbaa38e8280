"""``attnplug explain`` with ``spec_token_ids``: a verifying step's layout (drafts after the
row's token, a slot per draft, ``seq_lens`` of the optimistic length), its ``spec_decode``
metadata, the rolled-back next step writing over the rejected draft's slot, and bad
``spec_token_ids`` named on one line (exit 2)."""

from __future__ import annotations

import io
import json

from attnplug.runner.commands.explain import run

CONFIG = {"config": {"block_sizes": [4], "max_num_reqs": 4, "max_model_len": 32, "max_num_batched_tokens": 16}}
STEPS = [
    {"new": [{"req_id": "A", "prompt_token_ids": [1, 2, 3, 1, 2], "block_ids": [[1, 2]]},
             {"req_id": "B", "prompt_token_ids": [7, 8], "block_ids": [[3]]}],
     "num_scheduled_tokens": {"A": 5, "B": 2}},
    # A verifies 3 drafts (1 + 3 tokens), B decodes one token
    {"cached": [{"req_id": "A", "new_token_ids": [3], "new_block_ids": [[4]], "num_computed_tokens": 5},
                {"req_id": "B", "new_token_ids": [9], "num_computed_tokens": 2}],
     "num_scheduled_tokens": {"A": 4, "B": 1}, "spec_token_ids": {"A": [1, 2, 3]}},
    # 2 drafts accepted + bonus 5: num_computed_tokens 5 + 1 + 2 = 8, the third draft rejected
    {"cached": [{"req_id": "A", "new_token_ids": [1, 2, 5], "num_computed_tokens": 8},
                {"req_id": "B", "new_token_ids": [4], "num_computed_tokens": 3}],
     "num_scheduled_tokens": {"A": 1, "B": 1}},
]


def _explain(lines):
    out, err = io.StringIO(), io.StringIO()
    rc = run(io.StringIO("\n".join(json.dumps(x) for x in lines)), out, err, check=True)
    return rc, [json.loads(x) for x in out.getvalue().splitlines()], err.getvalue()


def test_verifying_step_and_its_rollback():
    rc, steps, err = _explain([CONFIG, *STEPS])
    assert rc == 0, err
    s = steps[1]
    assert s["input_ids"] == [3, 1, 2, 3, 9] and s["positions"] == [5, 6, 7, 8, 2]
    assert s["seq_lens"] == [9, 3] and s["discard"] == [False, False] and s["max_query_len"] == 4
    assert s["slot_mapping"] == [[9, 10, 11, 16, 14]]  # block 2 then block 4: one slot per draft
    assert s["spec_decode"] == {"num_draft_tokens": [3, 0], "cu_num_draft_tokens": [3, 3],
                                "draft_token_ids": [1, 2, 3], "target_logits_indices": [0, 1, 2],
                                "bonus_logits_indices": [3, 4], "logits_indices": [0, 1, 2, 3, 4]}
    assert "spec_decode" not in steps[0] and "spec_decode" not in steps[2]  # steps without drafts
    # the next step computes the bonus token at position 8, over the rejected draft's slot 16
    assert steps[2]["input_ids"] == [5, 4] and steps[2]["positions"] == [8, 3]
    assert steps[2]["seq_lens"] == [9, 4] and steps[2]["slot_mapping"] == [[16, 15]]


def test_bad_spec_token_ids_are_named_on_one_line():
    for bad, msg in [({"A": [1, "x", 3]}, "field 'spec_token_ids.A' of request 'A'"),
                     ({"A": [1, 2]}, "field 'scheduled_spec_decode_tokens' of request 'A'"),
                     ([1], "field 'spec_token_ids'")]:
        step = {**STEPS[1], "spec_token_ids": bad}
        rc, steps, err = _explain([CONFIG, STEPS[0], step])
        assert rc == 2 and len(steps) == 1 and msg in err and err.count("\n") == 1, err
