"""Serving metrics equal hand-computed values: vLLM bench serve's definitions of TTFT, TPOT,
ITL (one value per chunk: a multi-token speculative step is one gap), E2EL, throughput and
goodput (``metric <= SLO``; a one-token request has TPOT 0 for goodput), on a synthetic run."""

from __future__ import annotations

import pytest

from attnplug.runner.commands.serving_metrics import parse_goodput, percentile_key, serving_metrics
from attnplug.runner.serve.request_timing import RequestTiming

# A: arrives 0.0, three chunks of one token at 0.2, 0.3, 0.5
# B: arrives 1.0, one token at 1.4, then three at once at 1.5 (a step that accepted 2 drafts)
# C: arrives 2.0, one token at 2.1
TIMINGS = [RequestTiming(0.0, [0.2, 0.3, 0.5], [1, 1, 1]),
           RequestTiming(1.0, [1.4, 1.5], [1, 3]),
           RequestTiming(2.0, [2.1], [1])]
PROMPTS, OUTPUTS, DURATION = [10, 20, 30], [3, 4, 1], 2.5

# by hand (ms):
#   TTFT  = [200, 400, 100]              mean 233.333  median 200  std sqrt(46666.67/3) = 124.722
#           sorted [100, 200, 400]: p90 at rank 1.8 = 200 + 0.8*200 = 360, p99 at 1.98 = 396
#   TPOT  = A (500-200)/(3-1) = 150, B (500-400)/(4-1) = 33.333, C none (one token)
#           mean 91.667  median 91.667  std 58.333  p90 = 33.333 + 0.9*116.667 = 138.333  p99 = 148.833
#   ITL   = A [100, 200], B [100] (one chunk of three tokens: one gap), C []
#           mean 133.333  median 100  std sqrt(6666.67/3) = 47.140  p90 = 100 + 0.8*100 = 180  p99 = 198
#   E2EL  = [500, 500, 100]              mean 366.667  median 500  std sqrt(106666.67/3) = 188.562
#           sorted [100, 500, 500]: p90 = p99 = 500
HAND = {
    "mean_ttft_ms": 233.3333, "median_ttft_ms": 200.0, "std_ttft_ms": 124.7219, "p90_ttft_ms": 360.0,
    "p99_ttft_ms": 396.0,
    "mean_tpot_ms": 91.6667, "median_tpot_ms": 91.6667, "std_tpot_ms": 58.3333, "p90_tpot_ms": 138.3333,
    "p99_tpot_ms": 148.8333,
    "mean_itl_ms": 133.3333, "median_itl_ms": 100.0, "std_itl_ms": 47.1405, "p90_itl_ms": 180.0,
    "p99_itl_ms": 198.0,
    "mean_e2el_ms": 366.6667, "median_e2el_ms": 500.0, "std_e2el_ms": 188.5618, "p90_e2el_ms": 500.0,
    "p99_e2el_ms": 500.0,
    # 3 requests, 60 prompt + 8 output tokens over 2.5 s
    "duration": 2.5, "completed": 3, "failed": 0, "total_input_tokens": 60, "total_output_tokens": 8,
    "request_throughput": 1.2, "output_throughput": 3.2, "total_token_throughput": 27.2,
}


def test_every_figure_equals_the_hand_computed_value():
    got = serving_metrics(TIMINGS, PROMPTS, OUTPUTS, DURATION)
    for key, want in HAND.items():
        assert got[key] == pytest.approx(want, abs=1e-3), key
    assert got["request_goodput"] is None  # no --goodput: None, as in vLLM's result file


@pytest.mark.parametrize("slo,good", [
    ({"ttft": 300, "tpot": 200}, 2),   # A (200, 150) and C (100, 0); B's TTFT 400 misses
    ({"ttft": 200}, 2),                # A at exactly its objective counts (metric <= SLO)
    ({"tpot": 100}, 2),                # B (33.3) and C (one token: TPOT 0); A's 150 misses
    ({"e2el": 499}, 1),                # only C
    ({"ttft": 50}, 0),
])
def test_goodput_counts_requests_within_every_objective(slo, good):
    got = serving_metrics(TIMINGS, PROMPTS, OUTPUTS, DURATION, goodput={k: float(v) for k, v in slo.items()})
    assert got["request_goodput"] == pytest.approx(good / DURATION)


def test_a_request_without_tokens_is_failed_and_empty_lists_give_zero():
    got = serving_metrics([RequestTiming(0.0), RequestTiming(0.0, [0.5], [1])], [4, 4], [0, 1], 1.0)
    assert (got["completed"], got["failed"], got["total_input_tokens"]) == (1, 1, 4)
    assert got["mean_tpot_ms"] == got["p99_itl_ms"] == 0.0  # vLLM: np.mean(x or 0)
    assert got["mean_ttft_ms"] == pytest.approx(500.0)


def test_percentile_keys_follow_vllm_spelling():
    assert percentile_key(99.0, "ttft") == "p99_ttft_ms" and percentile_key(99.9, "itl") == "p99.9_itl_ms"
    got = serving_metrics(TIMINGS, PROMPTS, OUTPUTS, DURATION, percentiles=(50.0, 99.9))
    assert got["p50_ttft_ms"] == pytest.approx(200.0) and "p99.9_e2el_ms" in got and "p90_ttft_ms" not in got


@pytest.mark.parametrize("bad,why", [(["ttft=5"], "expected KEY:MS"), (["foo:5"], "unknown metric"),
                                     (["ttft:-1"], ">= 0"), (["ttft:x"], "not a number"),
                                     (["ttft:5", "ttft:6"], "twice"), (["ttft:nan"], ">= 0")])
def test_bad_goodput_is_one_line_naming_the_pair(bad, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_goodput(bad)
    assert "\n" not in str(e.value) and bad[-1] in str(e.value)
    assert parse_goodput(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
