"""`attnplug run --prefix-caching`: the shared-prefix workload (runner/commands/shared_prefixes.py)
hits the cache, reports hit rate / tokens saved / cascade steps / peak blocks, and gives the
same outputs_digest as the same workload with caching off (--shared-prefixes) and with
cascade attention off (--no-cascade)."""

from __future__ import annotations

import json

import pytest

from attnplug.core.errors import AttnplugError
from attnplug.runner.commands.run import main as run_main
from attnplug.runner.commands.shared_prefixes import make_shared_prefix_prompts

BASE = ["--model", "tiny-llama", "--num-requests", "12", "--max-model-len", "512", "--max-num-seqs", "4",
        "--block-size", "8", "--system-prompt-len", "24", "--cascade-min-prefix-len", "8", "--cascade-min-num-reqs", "2",
        "--invariance-requests", "0", "--json"]


def _run(capsys, extra) -> dict:
    assert run_main(BASE + extra) == 0
    return json.loads(capsys.readouterr().out)


def test_prefix_caching_hits_and_changes_no_output(capsys):
    on = _run(capsys, ["--prefix-caching"])
    pc = on["prefix_caching"]
    assert pc["enabled"] and pc["disabled_reason"] is None
    assert pc["hit_requests"] >= 4 and pc["hit_tokens"] >= 4 * 16 and 0 < pc["hit_rate"] < 1
    assert pc["hit_rate"] == pytest.approx(pc["hit_tokens"] / pc["query_tokens"], abs=1e-4)
    assert on["cascade"]["steps"] >= 1 and len(on["peak_kv_blocks_per_group"]) == 1
    off = _run(capsys, ["--shared-prefixes"])
    assert off["prefix_caching"] == {"enabled": False, "disabled_reason": "prefix caching is off"}
    no_cascade = _run(capsys, ["--prefix-caching", "--no-cascade"])
    assert no_cascade["cascade"]["steps"] == 0
    assert on["outputs_digest"] == off["outputs_digest"] == no_cascade["outputs_digest"]
    assert on["scheduled_tokens"] < off["scheduled_tokens"]  # the hits were not computed


def test_shared_prefix_prompts_keep_the_trace_lengths_and_share_system_prompts():
    lens = [5, 50, 70, 3, 90, 60]
    ps = make_shared_prefix_prompts(lens, 100, seed=1, num_system_prompts=2, system_prompt_len=32,
                                    continuation_prob=0.0)
    assert [len(p) for p in ps] == lens
    assert ps[1][:32] == ps[5][:32] and ps[2][:32] == ps[4][:32] and ps[1][:32] != ps[2][:32]
    assert ps[0][:4] == ps[2][:4]  # a short prompt keeps its last token its own
    cont = make_shared_prefix_prompts([40, 60, 80], 100, seed=1, system_prompt_len=8, continuation_prob=1.0)
    assert cont[1][:40 - 1] == cont[0][:39] and make_shared_prefix_prompts([40, 60, 80], 100, seed=1,
                                                                           system_prompt_len=8,
                                                                           continuation_prob=1.0) == cont
    with pytest.raises(AttnplugError, match="continuation_prob"):
        make_shared_prefix_prompts([4], 100, continuation_prob=2.0)
