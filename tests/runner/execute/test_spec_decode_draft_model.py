"""The draft-model drafter (``--speculative draft:k=N,model=...``,
``runner/execute/spec_decode/draft_model.py``) on real tiny random-init Llama models.

* Greedy output with a draft model is token-identical to greedy without speculation, under
  chunked prefill and forced preemption, with a smaller draft model and with the target's
  own config and seed as the draft model; the latter's drafts are the target's own greedy
  tokens, so every draft must be accepted (acceptance rate exactly 1.0): a drafter whose
  cache, positions or rollback were off would propose something else.
* The drafter alone, over histories with random partial acceptance (the target's rejected
  drafts replaced by other tokens): its drafts always equal those of a drafter that starts
  from an empty cache, so nothing it rolled back is ever read; also when its pool is so small
  that it evicts.
* Bad draft models are one-line ``ConfigError``s (``attnplug run`` exits 2).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from attnplug.core.errors import ConfigError
from attnplug.runner.commands.assemble import build_engine, resolve_backend
from attnplug.runner.commands.model_loading import build_with_backends
from attnplug.runner.commands.run import main as _run_main


def run_main(argv: list[str]) -> int:
    """``attnplug run`` on the random-weight preset these tests were written for (the
    default model is now SmolLM2's real weights), unless ``argv`` names a model."""
    return _run_main(argv if "--model" in argv else ["--model", "tiny-hybrid", *argv])
from attnplug.runner.commands.speculative import resolve_speculative
from attnplug.runner.execute.spec_decode.draft_model import DraftModelDrafter
from attnplug.runner.step.scheduler_output import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from test_async_scheduling import LLAMA  # noqa: E402
from test_parity_hybrid import BAMBA  # noqa: E402
from test_parity_sliding import GEMMA3  # noqa: E402

SMALL = {**LLAMA, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1}
"""A smaller Llama of the same vocabulary (96) as ``LLAMA``."""

REQUESTS = [([5, 9, 2, 7, 5, 9, 2, 7, 5, 9], SamplingParams(max_tokens=10)),
            (list(range(20, 37)), SamplingParams(max_tokens=8)),
            ([3, 1, 4, 1, 5], SamplingParams(max_tokens=9)),
            ([7] * 6, SamplingParams(temperature=1.0, seed=3, max_tokens=6))]


def _write(tmp_path, name, cfg) -> str:
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def _engine(target: str, spec: str | None, *, preempt=None, budget=12, max_num_seqs=4):
    args = SimpleNamespace(model=target, backend=None, block_size=4, seed=5, max_model_len=64,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_blocks=None,
                           record_logits=False, force_preemption_every=preempt, async_scheduling=False,
                           speculative=spec)
    return build_engine(args, requests=False).engine


def _run(eng, requests) -> dict[str, list[int]]:
    for i, (prompt, sp) in enumerate(requests):
        eng.add_request(f"r{i}", prompt, sp)
    eng.run()
    return {rid: r.output_token_ids for rid, r in sorted(eng.results.items())}


@pytest.mark.parametrize("draft, preempt", [("self", 3), ("small", 3)])
def test_greedy_with_a_draft_model_equals_greedy_without(tmp_path, draft, preempt):
    """``self``: the draft model is the target's config with the target's seed, so its drafts
    are the target's own greedy tokens and every one must be accepted (greedy rows only:
    a sampled row may reject). ``small``: a smaller draft model, a sampled row too."""
    target = _write(tmp_path, "target", LLAMA)
    model = target if draft == "self" else _write(tmp_path, "small", SMALL)
    requests = REQUESTS[:3] if draft == "self" else REQUESTS
    base = _run(_engine(target, None, preempt=preempt), requests)
    eng = _engine(target, f"draft:k=3,model={model}", preempt=preempt)
    out = _run(eng, requests)
    for rid in ("r0", "r1", "r2"):  # the greedy rows
        assert out[rid] == base[rid], rid
    assert all(len(out[f"r{i}"]) == sp.max_tokens for i, (_, sp) in enumerate(requests))
    stats = eng.scheduler.spec.stats
    assert stats.num_draft_tokens > 0
    if draft == "self":
        assert stats.num_draft_tokens > 10 and stats.num_accepted_tokens == stats.num_draft_tokens, stats
    if preempt:
        assert eng.scheduler.num_preemptions > 0
    assert all(m.req_to_blocks == {} for m in eng.scheduler.kv_cache_manager.managers)


def test_greedy_with_a_smaller_draft_model_matches_hf_under_preemption(tmp_path):
    pytest.importorskip("transformers")
    from attnplug.runner.commands.parity import run_parity

    small = _write(tmp_path, "small", SMALL)
    res = run_parity(LLAMA, num_requests=2, seed=1, force_preemption=True, max_tokens=6,
                     max_num_batched_tokens=16, prompt_len_range=(3, 20), speculative=f"draft:k=3,model={small}")
    assert res.ok, res.line()
    assert res.spec["proposed"] > 0 and res.preemptions > 0


def _drafter(cfg, max_num_seqs=2):
    model = build_with_backends(cfg, backend=None, block_size=4, resolve=resolve_backend, seed=1)
    return DraftModelDrafter(model, block_size=4, max_num_seqs=max_num_seqs, max_model_len=64)


@pytest.mark.parametrize("cfg, max_num_seqs", [(SMALL, 2), (SMALL, 1), (GEMMA3, 2)],
                         ids=["kept", "evicting", "gemma3-sliding-window"])
def test_drafts_after_partial_acceptance_equal_a_fresh_drafters(cfg, max_num_seqs):
    """Histories grow as the target would make them: ``a`` of the ``k`` drafts accepted, then
    a corrected token that differs from draft ``a`` (or a bonus token); now and then an
    earlier token changes too (the drafter must not trust its cache past it). Two requests
    alternate, so with one request's room the drafter evicts on every call. Gemma3: a
    sliding-window and a full-attention cache group in the draft model (histories pass the
    window of 7)."""
    drafter, fresh = _drafter(cfg, max_num_seqs), _drafter(cfg, 1)
    vocab = cfg["vocab_size"]
    rng = random.Random(0)
    hist = {"a": [5, 9, 2, 7, 5], "b": [1, 2, 3]}
    rollbacks = 0
    for _ in range(10):
        for rid, h in hist.items():
            k = rng.randint(1, 3)
            drafts = drafter.propose([h], k, req_ids=[rid])[0]
            assert drafts == fresh.propose([h], k)[0], (rid, h)  # fresh: no req_ids, empty cache
            assert len(drafts) == k
            a = rng.randint(0, k)
            nxt = rng.choice([t for t in range(vocab) if a == k or t != drafts[a]])
            rollbacks += a < k
            h.extend(drafts[:a] + [nxt])
            if rng.random() < 0.2:  # a history that changed earlier on: the valid prefix ends there
                h[rng.randrange(len(h) - 1)] = rng.randrange(vocab)
    assert rollbacks > 5
    assert drafter.num_recomputed_tokens < fresh.num_recomputed_tokens or max_num_seqs == 1


def test_bad_draft_models_are_refused_in_one_line(tmp_path):
    target = _write(tmp_path, "target", LLAMA)
    cases = [(_write(tmp_path, "vocab", {**SMALL, "vocab_size": 97}), "vocab_size is 97, the target's 96"),
             (_write(tmp_path, "mamba", {**BAMBA, "vocab_size": 96}), "Mamba state groups"),
             (str(tmp_path / "missing.json"), "not found")]
    for path, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            _engine(target, f"draft:k=2,model={path}")
        assert str(e.value).startswith(f"--speculative model={path}: ") and "\n" not in str(e.value)


def test_cli_and_config_file(tmp_path, capsys, monkeypatch):
    target = _write(tmp_path, "target", LLAMA)
    (tmp_path / "attnplug.toml").write_text('[speculative]\nmethod = "draft"\nk = 2\nmodel = "target.json"\n')
    monkeypatch.chdir(tmp_path)
    spec = resolve_speculative(None)
    assert (spec.method, spec.k, spec.model) == ("draft", 2, "target.json")
    (tmp_path / "attnplug.toml").write_text('[speculative]\nmethod = "draft"\nk = 2\nmodel = 3\n')
    with pytest.raises(ConfigError, match=r"\[speculative\] model: must be a non-empty path"):
        resolve_speculative(None)
    (tmp_path / "trace.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,9,12\n1,5,10\n")
    argv = ["--model", target, "--trace", "trace.csv", "--max-model-len", "64", "--invariance-requests", "0"]
    assert run_main(argv + ["--speculative", "draft:k=2,model=nowhere.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--speculative model=nowhere.json" in err and "not found" in err and "\n" not in err, err
    assert run_main(argv + ["--speculative", "draft:k=2,model=target.json", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["speculative"]
    assert s["method"] == "draft" and s["acceptance_rate"] == 1.0 and s["draft_tokens"] > 0, s
