"""`attnplug run`: the main job end to end on the bundled trace."""

from __future__ import annotations

import json

import pytest

from attnplug.runner.commands.run import main as _run_main


def run_main(argv: list[str]) -> int:
    """``attnplug run`` on the random-weight preset these tests were written for (the
    default model is now SmolLM2's real weights), unless ``argv`` names a model."""
    return _run_main(argv if "--model" in argv else ["--model", "tiny-hybrid", *argv])

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "initializer_range": 0.1}


def _run_json(capsys, argv) -> dict:
    assert run_main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_json_counts(capsys):
    s = _run_json(capsys, ["--num-requests", "16", "--max-model-len", "512"])
    assert s["requests"] == 16
    assert s["steps"] > 0 and s["generated_tokens"] >= 16
    assert s["batch_invariance"] == {"identical": 8, "checked": 8}
    assert s["cache_groups"][0]["backend"] == "cpu_sdpa"
    assert s["prompt_tokens"] + s["generated_tokens"] >= s["scheduled_tokens"] - s["prompt_tokens"] * 0
    assert set(s["median_us_per_step"]) == {"update_states", "prepare_inputs", "metadata_build", "forward", "sample"}
    assert all(v > 0 for v in s["median_us_per_step"].values())
    assert 0 < s["peak_kv_blocks_per_group"][0] < s["num_blocks_per_group"]
    assert "CC-BY 4.0" in s["trace"]["attribution"] and "Patel et al." in s["trace"]["attribution"]


def test_run_table_names_the_bundled_trace_and_its_licence(capsys):
    assert run_main(["--num-requests", "2", "--max-model-len", "512", "--invariance-requests", "0"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert "Request lengths: bundled trace `conv`" in out and "CC-BY 4.0" in out


def test_engine_validates_every_step_on_hundreds_of_requests(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    s = _run_json(capsys, ["--model", str(cfg), "--num-requests", "300", "--max-model-len", "256",
                           "--max-num-batched-tokens", "256", "--max-num-seqs", "32", "--block-size", "8",
                           "--num-blocks", "300", "--invariance-requests", "2"])
    assert s["requests"] == 300
    assert s["batch_invariance"]["identical"] == 2


def test_run_with_preemption_under_a_small_pool(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    s = _run_json(capsys, ["--model", str(cfg), "--num-requests", "24", "--max-model-len", "1024",
                           "--max-num-seqs", "16", "--block-size", "8", "--num-blocks", "70",
                           "--invariance-requests", "4"])
    assert s["requests"] == 24
    assert s["preemptions"] > 0
    assert s["batch_invariance"]["identical"] == 4


@pytest.mark.parametrize("row,msg", [("2023-11-16 18:15:46.68,abc,4", "line 3"),
                                     ("2023-11-16 18:15:46.68,-5,4", "line 3"),
                                     ("2023-11-16 18:15:46.68,5,0", "line 3"),
                                     ("2023-11-16 18:15:46.68,5000,4", "line 3")])
def test_bad_trace_row_is_one_clear_line(tmp_path, capsys, row, msg):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.60,10,3\n" + row + "\n")
    assert run_main(["--trace", str(trace), "--num-requests", "2", "--max-model-len", "512"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err and str(trace) in err


def test_skip_invalid_counts(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.60,10,3\n"
                     "2023-11-16 18:15:46.70,oops,3\n2023-11-16 18:15:46.80,12,2\n")
    s = _run_json(capsys, ["--trace", str(trace), "--skip-invalid", "--max-model-len", "512",
                           "--invariance-requests", "1"])
    assert s["requests"] == 2 and s["trace"]["skipped_rows"] == 1
    assert "attribution" not in s["trace"], "a user's own file needs no attribution of ours"


def test_pool_too_small_for_a_request_is_one_clear_error(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert run_main(["--model", str(cfg), "--num-requests", "24", "--max-model-len", "1024",
                     "--block-size", "8", "--num-blocks", "20"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnplug run: ") and "num_blocks" in err and "Traceback" not in err


def test_unknown_backend_is_an_error(capsys):
    assert run_main(["--backend", "nope", "--num-requests", "1"]) == 2
    assert "torch_native" in capsys.readouterr().err


def test_device_option_builds_everything_on_that_device(capsys, monkeypatch):
    """``--device`` reaches the model, the backend selection and the runner: on a machine
    without CUDA, ``--device cuda`` is one line saying so (exit 2, before anything is built),
    ``--device cpu`` runs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (tests/gpu/run_all.sh runs --device cuda)")
    with pytest.raises(SystemExit) as ei:
        run_main(["--device", "cuda", "--num-requests", "2"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1, err
    assert "--device: cuda: this machine has no CUDA (torch.cuda.is_available() is False); use cpu" in err
    s = _run_json(capsys, ["--device", "cpu", "--num-requests", "2", "--invariance-requests", "1"])
    assert s["requests"] == 2 and s["batch_invariance"] == {"identical": 1, "checked": 1}


def test_disabled_invariance_check_says_not_checked(capsys):
    assert run_main(["--model", "tiny-llama", "--num-requests", "1", "--max-model-len", "512",
                     "--invariance-requests", "0"]) == 0
    out = capsys.readouterr().out
    assert "not checked" in out and "0/0" not in out


def test_backend_help_documents_the_per_kind_form():
    from attnplug.runner.commands.run import _parser

    text = " ".join(_parser().format_help().split())
    assert "KIND=NAME[,KIND=NAME...]" in text and "full_attention=triton,sliding_window=torch_native" in text
    assert "attention backend for every group" not in text


def test_unknown_name_for_a_kind_the_model_lacks_is_an_error(capsys, monkeypatch, tmp_path):
    """tiny-llama has no Mamba and no sliding-window group: bad names for them still fail, naming the source."""
    monkeypatch.chdir(tmp_path)
    assert run_main(["--model", "tiny-llama", "--backend", "mamba=nonexistent", "--num-requests", "1"]) == 2
    assert "--backend mamba=nonexistent" in capsys.readouterr().err
    monkeypatch.setenv("ATTNPLUG_BACKEND_MAMBA", "nonexistent")
    assert run_main(["--model", "tiny-llama", "--num-requests", "1"]) == 2
    assert "env ATTNPLUG_BACKEND_MAMBA" in capsys.readouterr().err
    monkeypatch.delenv("ATTNPLUG_BACKEND_MAMBA")
    (tmp_path / "attnplug.toml").write_text('[backend]\nsliding_window = "nonexistent"\n')
    assert run_main(["--model", "tiny-llama", "--num-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'attnplug.toml'} [backend] sliding_window" in err and "unknown backend 'nonexistent'" in err


@pytest.mark.parametrize("argv, what", [
    (["--num-blocks", "1e11"], "argument --num-blocks: expected an integer in [2, 2147483647], got '1e11'"),
    (["--num-blocks", "3e6"], "argument --num-blocks: expected an integer"),
    (["--num-blocks", "100000000000"], "100000000000 is out of range: must be in [2, 2147483647]"),
    (["--num-blocks", "0"], "argument --num-blocks: 0 is out of range"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: 0 is out of range: must be in [1, 4096]"),
    (["--invariance-requests", "-1"], "argument --invariance-requests: -1 is out of range"),
    (["--max-model-len", "1_024"], "argument --max-model-len: expected an integer"),
    (["--block-size", "\uff11\uff16"], "argument --block-size: expected an integer"),
    (["--seed", "-3"], "argument --seed: -3 is out of range"),
])
def test_bad_flags_are_one_line_at_parse_time(capsys, argv, what):
    with pytest.raises(SystemExit) as e:
        run_main(argv + ["--num-requests", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("attnplug run: error: ") and what in err and "Traceback" not in err


def test_a_kv_pool_larger_than_memory_is_refused_before_allocating(capsys, monkeypatch):
    import attnplug.runner.commands.limits as limits
    import attnplug.runner.execute.kv_caches as kv_caches

    monkeypatch.setattr(limits, "available_memory_bytes", lambda: 2**30)  # 1 GiB
    monkeypatch.setattr(kv_caches, "allocate_kv_caches", lambda *a, **k: pytest.fail("allocated"))
    assert run_main(["--model", "tiny-llama", "--num-blocks", "200000", "--num-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("attnplug run: 200000 blocks per cache group (--num-blocks)")
    assert "GiB, more than 80% of the 1.00 GiB of memory available" in err


def test_available_memory_is_read_without_psutil():
    from attnplug.runner.commands.limits import available_memory_bytes, memory_problem

    avail = available_memory_bytes()
    assert avail is None or avail > 2**20
    assert memory_problem("x", 10, available=100) is None
    assert "need 0.00 GiB, more than 80% of the" in memory_problem("x", 90, available=100)


TRACE_HEAD = b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.60,10,3\n"


@pytest.mark.parametrize("row, what", [
    (b"1,1e400,3\n", "line 3: ContextTokens must be an integer, got '1e400'"),
    (b"1,\xff,3\n", "line 3: ContextTokens is not valid UTF-8"),
    (b"1,5," + b"7" * 140_000 + b"\n", "line 3: GeneratedTokens is longer than 131072 characters"),
])
def test_bad_trace_bytes_exit_2_with_one_line(tmp_path, capsys, row, what):
    trace = tmp_path / "t.csv"
    trace.write_bytes(TRACE_HEAD + row)
    assert run_main(["--model", "tiny-llama", "--trace", str(trace), "--max-model-len", "512"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and what in err and "Traceback" not in err, err[:300]


def test_skip_invalid_skips_every_kind_and_says_how_many(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_bytes(TRACE_HEAD + b"1,1e400,3\n1,\xff,3\n1,5," + b"7" * 140_000 + b"\nnan,4,4\n2,8,2\n")
    assert run_main(["--model", "tiny-llama", "--trace", str(trace), "--skip-invalid", "--max-model-len", "512",
                     "--invariance-requests", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    s = json.loads(out)
    assert s["requests"] == 2 and s["trace"]["skipped_rows"] == 4
    assert "attnplug run: --skip-invalid skipped 4 invalid trace rows; the first: " in err
    assert f"{trace}, line 3: ContextTokens must be an integer" in err


@pytest.mark.parametrize("preset", [None, "tiny-hybrid"])
def test_async_scheduling_gives_the_same_outputs_digest(capsys, tmp_path, preset):
    """`--async-scheduling` on the bundled trace: the same digest, on a Llama config with
    preemption under a small pool, and on the default tiny-hybrid preset (full,
    sliding-window and Mamba2 groups)."""
    if preset is None:
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps(TINY))
        argv = ["--model", str(cfg), "--num-requests", "24", "--max-model-len", "1024", "--max-num-seqs", "16",
                "--block-size", "8", "--num-blocks", "70", "--invariance-requests", "0"]
    else:
        argv = ["--model", preset, "--num-requests", "12", "--max-model-len", "512", "--invariance-requests", "0"]
    sync = _run_json(capsys, argv)
    asy = _run_json(capsys, argv + ["--async-scheduling"])
    assert (sync["async_scheduling"], asy["async_scheduling"]) == (False, True)
    assert len(sync["outputs_digest"]) == 64 and asy["outputs_digest"] == sync["outputs_digest"]
    assert asy["generated_tokens"] == sync["generated_tokens"]
    if preset is None:
        assert sync["preemptions"] > 0 and asy["preemptions"] > 0
    assert sync["output_waits"] == 0 and 0 < asy["output_waits"] <= asy["steps"]
    assert sync["torch_threads"] >= 1


def test_outputs_digest_is_the_generated_tokens_in_request_order():
    import hashlib

    from attnplug.runner.commands.assemble import outputs_digest
    from attnplug.runner.serve.engine import RequestResult

    res = {rid: RequestResult(rid, [1], toks) for rid, toks in [("req-10", [3]), ("req-2", [5, 6])]}
    want = hashlib.sha256(json.dumps([["req-2", [5, 6]], ["req-10", [3]]]).encode()).hexdigest()
    assert outputs_digest(res) == want
    res["req-2"].output_token_ids[1] = 7
    assert outputs_digest(res) != want


def test_a_batch_invariance_failure_says_which_request_on_stderr(capsys, monkeypatch):
    """A non-zero exit always says why: a request whose batched outputs differ from its
    solo run is named with the first differing output."""
    from attnplug.runner.commands import run as run_mod

    real = run_mod.build_engine

    def skewed(args, **kw):  # the solo engines sample one token id higher
        setup = real(args, **kw)
        if kw.get("alone"):
            step = setup.engine.runner.sampler.__call__

            class Skew:
                def __call__(self, logits, params, gens):
                    return (step(logits, params, gens) + 1) % logits.shape[1]
            setup.engine.runner.sampler = Skew()
        return setup

    monkeypatch.setattr(run_mod, "build_engine", skewed)
    assert run_main(["--num-requests", "2", "--max-model-len", "512", "--invariance-requests", "1", "--json"]) == 1
    err = capsys.readouterr().err
    assert "batch invariance failed for 1 of 1 requests" in err and "request 'req-0': output 0 is" in err
