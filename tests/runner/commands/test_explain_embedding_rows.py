"""``attnplug explain`` with prompt embeddings and M-RoPE: a step's ``is_embed`` marks
exactly the scheduled prompt rows of the request given embeddings, ``mrope_positions``
gives an image's grid positions and the continuation after it (``position + delta``);
embeddings of the wrong width, a malformed embeddings row and a span outside the prompt
each exit 2 on one line naming the field.
"""

from __future__ import annotations

import io
import json

from attnplug.runner.commands.explain import run

CONFIG = {"config": {"block_sizes": [4], "max_num_reqs": 4, "max_model_len": 32, "max_num_batched_tokens": 16,
                     "prompt_embeds_hidden_size": 2, "uses_mrope": True}}
TXT = {"req_id": "txt", "prompt_token_ids": [5, 6, 7], "block_ids": [[1]]}
EMB = {"req_id": "emb", "prompt_token_ids": [0, 0, 0], "block_ids": [[2]],
       "prompt_embeds": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]}
IMG = {"req_id": "img", "prompt_token_ids": [1, 9, 9, 9, 9, 2], "block_ids": [[3, 4]],
       "mm_placeholders": [{"offset": 1, "grid_thw": [1, 2, 2]}]}


def explain(*steps) -> tuple[int, list[dict], str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run(io.StringIO("\n".join(json.dumps(s) for s in (CONFIG, *steps))), out, err, check=True)
    return rc, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def test_embedding_rows_and_mrope_positions_are_shown():
    rc, steps, err = explain(
        {"new": [TXT, EMB, IMG], "num_scheduled_tokens": {"txt": 3, "emb": 2, "img": 6}},
        {"cached": [{"req_id": "emb", "num_computed_tokens": 2}, {"req_id": "img", "num_computed_tokens": 6,
                                                                   "new_token_ids": [3]}],
         "num_scheduled_tokens": {"emb": 1, "img": 1}})
    assert rc == 0, err
    assert steps[0]["is_embed"] == [False] * 3 + [True] * 2 + [False] * 6
    img = steps[0]["req_ids"].index("img")
    s = steps[0]["query_start_loc"][img]
    # text 0, the 2x2 grid at 1 + (0, h, w), text after it at 1 + max(2, 2) = 3
    assert [row[s:s + 6] for row in steps[0]["mrope_positions"]] == [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3],
                                                                     [0, 1, 2, 1, 2, 3]]
    assert steps[1]["req_ids"] == ["img", "emb"] and steps[1]["is_embed"] == [False, True]
    assert [row[0] for row in steps[1]["mrope_positions"]] == [4, 4, 4]  # position 6 + delta (4 - 6)


def test_bad_embeddings_and_spans_exit_2_naming_the_field():
    wide = dict(EMB, prompt_embeds=[[0.0, 0.0, 0.0]] * 3)
    rc, _, err = explain({"new": [wide], "num_scheduled_tokens": {"emb": 3}})
    assert rc == 2 and "field 'prompt_embeds' of request 'emb'" in err and err.count("\n") == 1
    rc, _, err = explain({"new": [dict(EMB, prompt_embeds=[["x", 1]] * 3)], "num_scheduled_tokens": {"emb": 3}})
    assert rc == 2 and "new.prompt_embeds" in err
    far = dict(IMG, mm_placeholders=[{"offset": 4, "grid_thw": [1, 2, 2]}])
    rc, _, err = explain({"new": [far], "num_scheduled_tokens": {"img": 6}})
    assert rc == 2 and "field 'mm_placeholders' of request 'img'" in err
