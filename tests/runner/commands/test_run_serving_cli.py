"""``attnplug run`` as a serving replay: arrivals over wall-clock time, vLLM bench serve's
result keys in ``--json``, warm-up, repeats, sampling flags, ``--output-len``, a timed
trace; and every bad serving flag is one line on stderr with exit status 2."""

from __future__ import annotations

import json

import pytest

from attnplug.runner.commands.run import main as run_main

SMALL = ["--model", "tiny-hybrid", "--num-requests", "4", "--max-model-len", "256", "--invariance-requests", "1", "--json"]
VLLM_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "request_rate", "burstiness"] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p90", "p99")]


def _run_json(capsys, argv) -> dict:
    assert run_main(argv + SMALL) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_poisson_arrivals_warmup_repeats_and_goodput(capsys):
    s = _run_json(capsys, ["--request-rate", "20", "--burstiness", "2", "--warmup", "2", "--repeat", "2",
                           "--goodput", "ttft:60000", "e2el:60000"])
    assert all(k in s for k in VLLM_KEYS), [k for k in VLLM_KEYS if k not in s]
    assert s["arrivals"]["mode"] == "gamma" and s["request_rate"] == 20.0 and s["burstiness"] == 2.0
    assert s["completed"] == s["requests"] == 4 and s["warmup_requests"] == 2
    # the last request arrives at N / R = 0.2 s (vLLM's rescaling), so the run lasts longer
    assert s["duration"] > 0.2 and s["mean_e2el_ms"] >= s["mean_ttft_ms"] > 0
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])  # generous objectives: all good
    rep = s["repeats"]
    assert rep["runs"] == 2 and rep["outputs_identical"]
    f = rep["figures"]["mean_ttft_ms"]
    assert f["min"] <= f["median"] <= f["max"]
    assert s["peak_rss_bytes"] > 50 * 2**20
    assert all(g["kv_cache_bytes"] > 0 for g in s["cache_groups"])


def test_default_run_is_all_at_t0_and_output_len_overrides(capsys):
    s = _run_json(capsys, ["--output-len", "3"])
    assert s["arrivals"]["mode"] == "all at t=0" and s["request_rate"] == "inf" and s["request_goodput"] is None
    assert s["generated_tokens"] == s["total_output_tokens"] == 4 * 3


def test_seeded_sampling_is_batch_invariant(capsys):
    s = _run_json(capsys, ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--seed", "5"])
    greedy = _run_json(capsys, ["--seed", "5"])
    assert s["batch_invariance"] == {"identical": 1, "checked": 1}
    assert s["outputs_digest"] != greedy["outputs_digest"]


def test_timed_trace_replays_its_timestamps_and_shares_prefixes(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 40, "output_length": 2,
                                        "hash_ids": [7, 8, i]}) + "\n" for i in range(4)))
    s = _run_json(capsys, ["--trace", str(path), "--time-scale", "0.5", "--model", "tiny-llama",
                           "--prefix-caching", "--block-size", "16", "--timed-trace-chunk-hash-size", "16"])
    assert s["arrivals"] == {"mode": "trace timestamps", "request_rate": "inf", "burstiness": 1.0,
                             "time_scale": 0.5}
    assert s["duration"] > 0.15  # the last request arrives 300 ms x 0.5 after the first
    assert s["prefix_caching"]["hit_tokens"] >= 3 * 32  # blocks 7 and 8 are shared


@pytest.mark.parametrize("argv,msg", [
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "abc"], "--request-rate"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--request-rate", "2", "--burstiness", "0"], "--burstiness"),
    (["--burstiness", "2"], "give --request-rate too"),
    (["--time-scale", "0.5"], "--time-scale"),
    (["--request-rate", "2", "--trace-timestamps"], "not allowed with"),
    (["--goodput", "ttft=5"], "expected KEY:MS"),
    (["--goodput", "ttfb:5"], "unknown metric"),
    (["--goodput", "ttft:-3"], ">= 0"),
    (["--metric-percentiles", "0,99"], "--metric-percentiles"),
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--warmup", "-1"], "--warmup"),
    (["--repeat", "0"], "--repeat"),
])
def test_bad_serving_flag_is_one_line_exit_2(capsys, argv, msg):
    try:
        code = run_main(argv + SMALL)
    except SystemExit as e:  # argparse's own errors (OneLineParser: one line, status 2)
        code = e.code
    assert code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and msg in out.err, out.err


def test_malformed_timed_trace_line_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
                    '{"timestamp": 5, "input_length": -5, "output_length": 2}\n')
    assert run_main(["--trace", str(path)] + SMALL) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}, line 2: field 'input_length'" in err
