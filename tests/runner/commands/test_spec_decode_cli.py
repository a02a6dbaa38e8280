"""``attnplug run --speculative`` / ``[speculative]`` in attnplug.toml / ``attnplug parity
--speculative``: metrics in ``--json`` and the table, same outputs as without, bad values
as one line with exit 2."""

from __future__ import annotations

import json

import pytest

from attnplug.runner.commands.parity import main as parity_main
from attnplug.runner.commands.report import print_run_table
from attnplug.runner.commands.speculative import resolve_speculative
from attnplug.runner.execute.spec_decode.drafter import parse_speculative
from attnplug.runner.commands.run import main as _run_main


def run_main(argv: list[str]) -> int:
    """``attnplug run`` on the random-weight preset these tests were written for (the
    default model is now SmolLM2's real weights), unless ``argv`` names a model."""
    return _run_main(argv if "--model" in argv else ["--model", "tiny-hybrid", *argv])

SMALL_VOCAB = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 32,
               "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256, "initializer_range": 0.1}


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(SMALL_VOCAB))
    return str(p)


def _args(cfg):
    return ["--model", cfg, "--num-requests", "8", "--max-model-len", "512", "--max-num-batched-tokens", "128",
            "--block-size", "8", "--invariance-requests", "2"]


def _json(capsys, argv) -> dict:
    assert run_main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_json_reports_speculation_and_keeps_the_outputs(capsys, cfg):
    plain = _json(capsys, _args(cfg) + ["--invariance-requests", "0"])
    assert plain["speculative"] is None and plain["tokens_per_step"] > 0
    spec = _json(capsys, _args(cfg) + ["--speculative", "ngram:k=3"])
    s = spec["speculative"]
    assert s["method"] == "ngram" and s["k"] == 3
    assert 0 < s["accepted_tokens"] <= s["draft_tokens"]
    assert s["acceptance_rate"] == round(s["accepted_tokens"] / s["draft_tokens"], 4)
    assert s["mean_accepted_length"] == round(1 + s["accepted_tokens"] / s["verifications"], 3)
    assert spec["outputs_digest"] == plain["outputs_digest"]  # greedy: the same tokens
    assert spec["steps"] < plain["steps"] and spec["tokens_per_step"] > plain["tokens_per_step"]
    assert spec["batch_invariance"] == {"identical": 2, "checked": 2}
    print_run_table(spec)
    table = " ".join(capsys.readouterr().out.split())
    assert "acceptance rate" in table and "mean accepted length" in table and "ngram k=3" in table


def test_the_config_file_gives_the_same_choice(tmp_path):
    assert resolve_speculative(None, cwd=tmp_path) is None
    (tmp_path / "attnplug.toml").write_text('[speculative]\nmethod = "ngram"\nk = 3\nn = 2\n')
    assert resolve_speculative(None, cwd=tmp_path) == parse_speculative("ngram:k=3,n=2")
    assert resolve_speculative("ngram:k=1", cwd=tmp_path).k == 1  # the flag wins
    (tmp_path / "attnplug.toml").write_text('speculative = "ngram:k=4"\n')
    assert resolve_speculative(None, cwd=tmp_path).k == 4
    (tmp_path / "attnplug.toml").unlink()
    (tmp_path / "pyproject.toml").write_text('[tool.attnplug.speculative]\nmethod = "ngram"\nk = 2\n')
    assert resolve_speculative(None, cwd=tmp_path).k == 2


@pytest.mark.parametrize("toml, flag, msg", [
    (None, "ngram:k=0", "--speculative: k must be >= 1"),
    (None, "medusa:k=2", "unknown speculative method"),
    ('[speculative]\nmethod = "ngram"\nk = "3"\n', None, "[speculative] k: must be an integer"),
    ('speculative = "ngram"\n', None, "speculative: ngram needs k"),
])
def test_bad_speculative_values_are_one_line_exit_2(capsys, cfg, tmp_path, monkeypatch, toml, flag, msg):
    if toml is not None:
        (tmp_path / "attnplug.toml").write_text(toml)
    monkeypatch.chdir(tmp_path)
    argv = _args(cfg) + ["--invariance-requests", "0"] + (["--speculative", flag] if flag else [])
    assert run_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err, err


HYBRID_SMALL_VOCAB = {"model_type": "bamba", "architectures": ["BambaForCausalLM"], "vocab_size": 12,
                      "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_state": 8,
                      "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8,
                      "max_position_embeddings": 256, "initializer_range": 0.1, "rms_norm_eps": 1e-5}


def test_a_mamba_model_runs_with_drafts_and_keeps_its_outputs(capsys, tmp_path):
    path = tmp_path / "hybrid.json"   # Mamba2 state groups; a small vocabulary, so n-gram drafts exist
    path.write_text(json.dumps(HYBRID_SMALL_VOCAB))
    argv = ["--model", str(path), "--num-requests", "4", "--invariance-requests", "0", "--max-model-len", "128",
            "--output-len", "24"]
    plain, spec = _json(capsys, argv), _json(capsys, argv + ["--speculative", "ngram:k=2"])
    assert spec["speculative"]["accepted_tokens"] > 0
    assert spec["outputs_digest"] == plain["outputs_digest"]  # greedy: the same tokens


def test_parity_passes_speculative_to_run_parity(capsys, cfg, monkeypatch):
    """The flag reaches ``run_parity`` (whose speculative runs against HF are in
    ``test_spec_decode_engine.py``) and its result line reports the drafts."""
    from attnplug.runner.commands import parity

    seen = {}

    def fake(cfg_dict, **kw):
        seen.update(kw)
        return parity.ParityResult(True, 1, 1, 0.0, 1e-4, spec={"proposed": 5, "accepted": 3})

    monkeypatch.setattr(parity, "run_parity", fake)
    assert parity_main(["--hf-config", cfg, "--speculative", "ngram:k=3"]) == 0
    assert seen["speculative"] == "ngram:k=3"
    assert "3/5 drafts accepted" in capsys.readouterr().out
