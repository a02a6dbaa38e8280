"""Speculative decoding on a model with state groups (Bamba: Mamba2 + attention).

Greedy tokens with ``--speculative ngram:k=3`` equal HF transformers' (fp32) under chunked
prefill, and with ``--prefix-caching`` (checkpoints restored into requests that then
verify drafts), with drafts really accepted and really rejected (both counters > 0: the
scratch-slot commit and the rejected-draft path both run). A scheduler output with more
drafts than a request's state slots is refused in one line naming the request and the
field, and changes nothing; a configuration whose state pool holds fewer than ``1 + k``
slots per request is refused at construction.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from attnplug.core.errors import ConfigError, InvalidSchedulerOutput
from attnplug.runner.commands.assemble import build_engine, resolve_backend
from attnplug.runner.commands.model_loading import build_with_backends
from attnplug.runner.commands.parity import run_parity
from attnplug.runner.step.spec_apply import draft_state_copies
from attnplug.runner.step.compiler import snapshot_diff
from attnplug.runner.step.scheduler_output import SamplingParams
from attnplug.runner.step.packed_deltas import as_vllm_form, draft_tokens

sys.path.insert(0, str(Path(__file__).parent))
from test_parity_hybrid import BAMBA  # noqa: E402

SMALL_VOCAB = {**BAMBA, "num_hidden_layers": 2, "vocab_size": 12}
"""Mamba2 + attention; a 12-token vocabulary makes greedy outputs repeat, so n-gram drafts
are both accepted and rejected."""


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["chunked", "chunked+prefix-caching"])
def test_bamba_greedy_with_drafts_matches_hf(prefix_caching):
    pytest.importorskip("transformers")
    res = run_parity(SMALL_VOCAB, num_requests=4, seed=0, max_tokens=16, max_num_batched_tokens=16, block_size=4,
                     prompt_len_range=(10, 30) if prefix_caching else (3, 20), speculative="ngram:k=3",
                     prefix_caching=prefix_caching)
    assert res.ok, res.line()
    assert res.spec["accepted"] > 0, f"no draft was accepted: the state commit did not run ({res.spec})"
    assert res.spec["proposed"] > res.spec["accepted"], f"no draft was rejected ({res.spec})"


def engine(spec, *, slots_per_request=None, budget=16, cfg=BAMBA):
    model = build_with_backends(cfg, backend=None, block_size=4, resolve=resolve_backend, seed=3)
    args = SimpleNamespace(model=None, backend=None, block_size=4, seed=0, max_model_len=64, max_num_seqs=3,
                           max_num_batched_tokens=budget, num_blocks=None, record_logits=False,
                           force_preemption_every=None, async_scheduling=False, speculative=spec)
    return build_engine(args, model=model, requests=False).engine


def _qwen3_5():
    from test_parity_qwen3_next import QWEN3_5
    return dict(QWEN3_5, num_hidden_layers=2)


@pytest.mark.parametrize("family", ["bamba", "qwen3_5"])
def test_more_drafts_than_state_slots_is_refused_naming_request_and_field(family):
    """Mamba2 (Bamba) and GDN (Qwen3.5) state groups alike."""
    eng = engine("ngram:k=2", cfg=BAMBA if family == "bamba" else _qwen3_5())
    sched, runner = eng.scheduler, eng.runner
    # Qwen3.5's attention group comes second: a prompt short enough that its blocks hold the extra draft
    prompt = [4, 8] * (4 if family == "bamba" else 3)
    eng.add_request("a", prompt, SamplingParams(max_tokens=12))
    while True:
        out = sched.schedule()
        if draft_tokens(out).get("a"):
            out = as_vllm_form(out)  # (the scheduler packs its drafts: widened in vLLM's form below)
            break
        sched.update_from_output(out, runner.execute_model(out).sampled_token_ids)
    drafts = out.scheduled_spec_decode_tokens["a"]
    extra = 3 - len(drafts)   # 3 drafts; the request holds 1 + k = 3 state slots per state group
    out.scheduled_spec_decode_tokens["a"] = drafts + [drafts[-1]] * extra
    out.num_scheduled_tokens["a"] += extra
    out.total_num_scheduled_tokens += extra
    before = runner.compiler.snapshot()
    with pytest.raises(InvalidSchedulerOutput) as e:
        runner.execute_model(out)
    msg = str(e.value)
    assert "'a'" in msg and "scheduled_spec_decode_tokens" in msg and "state slots" in msg and "\n" not in msg
    assert snapshot_diff(before, runner.compiler.snapshot()) == []


def test_a_state_pool_for_fewer_drafts_is_refused_at_configuration():
    from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
    from attnplug.runner.execute.spec_decode.drafter import parse_speculative
    from attnplug.runner.serve.spec_schedule import check_spec_config

    model = build_with_backends(BAMBA, backend=None, block_size=4, resolve=resolve_backend, seed=3)
    groups = group_layers_by_spec(model.kv_cache_specs(4))
    spec = parse_speculative("ngram:k=3")
    check_spec_config(spec, False, KVCacheConfig(64, groups, num_state_slots=17, state_slots_per_request=4))
    with pytest.raises(ConfigError, match="state slot") as e:
        check_spec_config(spec, False, KVCacheConfig(64, groups, num_state_slots=17, state_slots_per_request=2))
    assert "\n" not in str(e.value)


def test_commit_copies_the_accepted_column_into_the_own_slot():
    table = np.array([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], dtype=np.int32)
    (src, dst), = draft_state_copies([table], [2, 0, 1], [[1, 2, 3], [4], [5, 6]])
    assert src.tolist() == [15, 10] and dst.tolist() == [13, 9]   # a = 2 (row 2), a = 0 (row 0: none), a = 1
