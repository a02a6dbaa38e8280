"""Trace loading: bundled Azure traces, user CSVs, scaling, errors naming the row."""

from __future__ import annotations

import pytest

from attnplug.core.errors import TraceFormatError
from attnplug.runner.commands.traces import (
    SOURCE_MAX_MODEL_LEN,
    LoadedTrace,
    TraceRequest,
    load_trace,
    make_prompts,
    resolve_trace_path,
)

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path, body, header=HEADER, name="t.csv"):
    p = tmp_path / name
    p.write_text(header + body)
    return str(p)


@pytest.mark.parametrize("name", ["conv", "code"])
def test_bundled_traces_load_scaled_to_the_model(name):
    t = load_trace(name, 200, max_model_len=512)
    assert isinstance(t, LoadedTrace) and len(t) == 200 and t.num_skipped == 0
    assert t.scale == SOURCE_MAX_MODEL_LEN / 512
    assert t[0].arrival_s == 0.0
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in t)
    assert all(r.prompt_len + r.output_len <= 512 for r in t)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(t, t[1:]))


def test_bundled_conv_first_rows_are_scaled_and_rounded():
    # first rows of the conv trace: (374, 44), (396, 109), (879, 55)
    t = load_trace("conv", 3, max_model_len=1024)
    assert [(r.prompt_len, r.output_len) for r in t] == [(47, 6), (50, 14), (110, 7)]
    assert t[1].arrival_s == pytest.approx(4.3145790, abs=1e-6)


def test_bundled_traces_clamp_long_requests():
    t = load_trace("conv", 2000, max_model_len=64, scale=1.0)
    assert len(t) == 2000 and 0 < t.num_clamped <= 2000
    assert all(r.prompt_len + r.output_len <= 64 and r.output_len <= 32 for r in t)


def test_user_csv_is_taken_as_is(tmp_path):
    p = write(tmp_path, "0,5,3\n0.5,7,1\n\n2.25,1,2\n")
    t = load_trace(p, None, max_model_len=16)
    assert list(t) == [TraceRequest(5, 3, 0.0), TraceRequest(7, 1, 0.5), TraceRequest(1, 2, 2.25)]
    assert t.scale == 1.0 and t.source == p


def test_columns_by_name_in_any_order(tmp_path):
    p = write(tmp_path, "3,2023-11-16 18:15:46.5,x,4\n", header="GeneratedTokens,TIMESTAMP,Extra,ContextTokens\n")
    assert list(load_trace(p, 1, max_model_len=16)) == [TraceRequest(4, 3, 0.0)]


@pytest.mark.parametrize("row, what", [
    ("0,abc,3", "ContextTokens must be an integer, got 'abc'"),
    ("0,0,3", "ContextTokens must be positive, got 0"),
    ("0,5,-2", "GeneratedTokens must be positive, got -2"),
    ("yesterday,5,2", "TIMESTAMP 'yesterday'"),
    ("0,5", "expected 3 fields, got 2"),
    ("0,10,7", "longer than max_model_len=16"),
])
def test_invalid_row_names_file_and_line(tmp_path, row, what):
    p = write(tmp_path, f"0,5,3\n1,4,4\n{row}\n3,2,2\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(p, None, max_model_len=16)
    msg = str(e.value)
    assert msg.startswith(f"{p}, line 4: ") and what in msg and "--skip-invalid" in msg
    assert "\n" not in msg


def test_skip_invalid_counts_and_skips(tmp_path):
    p = write(tmp_path, "0,5,3\n1,0,4\n2,x,1\n3,2,2\n4,50,1\n5,1,1\n")
    t = load_trace(p, None, max_model_len=16, skip_invalid=True)
    assert t.num_skipped == 3
    assert [(r.prompt_len, r.output_len) for r in t] == [(5, 3), (2, 2), (1, 1)]


def test_num_requests_stops_before_later_bad_rows(tmp_path):
    p = write(tmp_path, "0,5,3\n1,4,4\n2,bad,1\n")
    assert len(load_trace(p, 2, max_model_len=16)) == 2


def test_header_and_path_errors(tmp_path):
    p = write(tmp_path, "0,5,3\n", header="time,prompt,output\n")
    with pytest.raises(TraceFormatError, match=r"line 1: .*lacks column\(s\)"):
        load_trace(p, None, max_model_len=16)
    with pytest.raises(TraceFormatError, match="no such file; pass one of conv, code"):
        load_trace(str(tmp_path / "missing.csv"), 1, max_model_len=16)
    with pytest.raises(TraceFormatError, match="scale"):
        load_trace("conv", 1, max_model_len=16, scale=0)


def test_resolve_bundled_names():
    path, bundled = resolve_trace_path("code")
    assert bundled and path.endswith("azure_llm_2023_code.csv")


def test_make_prompts_is_deterministic_and_per_request():
    reqs = [TraceRequest(5, 1, 0.0), TraceRequest(3, 1, 0.0)]
    a = make_prompts(reqs, vocab_size=100, seed=7)
    assert [len(x) for x in a] == [5, 3]
    assert all(0 <= t < 100 and isinstance(t, int) for x in a for t in x)
    assert a == make_prompts(reqs, vocab_size=100, seed=7)
    assert make_prompts([reqs[0], TraceRequest(9, 1, 0.0)], 100, 7)[0] == a[0]
    assert make_prompts(reqs, 100, 8) != a
    with pytest.raises(TraceFormatError, match="vocab_size"):
        make_prompts(reqs, 0, 1)


def _bad(tmp_path, body: bytes, name="bad.csv"):
    p = tmp_path / name
    p.write_bytes(HEADER.encode() + b"0,5,3\n" + body + b"3,2,2\n")
    return str(p)


BAD_ROWS = [  # (row bytes, the line the error names, what it says)
    (b"1e400,5,3\n", "line 3", "TIMESTAMP '1e400' is out of range: seconds must be finite"),
    (b"1,1e400,3\n", "line 3", "ContextTokens must be an integer, got '1e400'"),
    (b"1," + b"9" * 5000 + b",3\n", "line 3", "ContextTokens must be an integer, got '999"),
    (b"1,5,30000000000\n", "line 3", "GeneratedTokens must be at most 2147483647"),
    (b"1,\xff\xfe,3\n", "line 3", "ContextTokens is not valid UTF-8: '\\xff\\xfe'"),
    (b"1,5," + b"7" * (128 * 1024 + 1) + b"\n", "line 3", "GeneratedTokens is longer than 131072 characters"),
    (b"1,5,3" + b",x" * 600_000 + b"\n", "line 3", "line longer than 1048576 bytes"),
    (b"nan,5,3\n", "line 3", "TIMESTAMP 'nan' is neither"),
    (b"inf,5,3\n", "line 3", "TIMESTAMP 'inf' is neither"),
    (b"-Infinity,5,3\n", "line 3", "TIMESTAMP '-Infinity' is neither"),
    ("1,\uff15,3\n".encode(), "line 3", "ContextTokens must be an integer, got '\uff15' (ASCII decimal digits"),
    (b"1,1_2,3\n", "line 3", "ContextTokens must be an integer, got '1_2'"),
    (b"1_0,5,3\n", "line 3", "TIMESTAMP '1_0' is neither"),
    ("\u0662023-11-16 18:15:46,5,3\n".encode(), "line 3", "is neither"),
    (b"2023-02-30 10:00:00,5,3\n", "line 3", "is not a valid date and time (day is out of range for month)"),
    (b'1,"5\n2",3\n', "lines 3-4", "ContextTokens must be an integer, got '5\\n2'"),
]


@pytest.mark.parametrize("row, where, what", BAD_ROWS, ids=range(len(BAD_ROWS)))
def test_every_kind_of_bad_row_is_one_line_or_skipped(tmp_path, row, where, what):
    p = _bad(tmp_path, row)
    with pytest.raises(TraceFormatError) as e:
        load_trace(p, None, max_model_len=64)
    msg = str(e.value)
    assert msg.startswith(f"{p}, {where}: ") and what in msg and msg.endswith("--skip-invalid to skip invalid rows")
    assert "\n" not in msg and len(msg) < 400, msg[:500]
    t = load_trace(p, None, max_model_len=64, skip_invalid=True)
    assert [(r.prompt_len, r.output_len) for r in t] == [(5, 3), (2, 2)]
    assert t.num_skipped == 1 and t.first_skipped == msg.split("; fix the row")[0]


def test_header_bytes_bom_and_limits(tmp_path):
    p = tmp_path / "h.csv"
    p.write_bytes(b"TIMESTAMP,Context\xffTokens,GeneratedTokens\n0,5,3\n")
    with pytest.raises(TraceFormatError, match=r"line 1: header column Context\\xffTokens is not valid UTF-8"):
        load_trace(str(p), None, max_model_len=64, skip_invalid=True)  # no header: nothing to skip to
    p.write_bytes(b"\xef\xbb\xbf" + HEADER.encode() + b" 2023-11-16 18:15:46.5 , 5 ,3\r\n")
    assert list(load_trace(str(p), None, max_model_len=64)) == [TraceRequest(5, 3, 0.0)]
    p.write_bytes(HEADER.encode() + b"1e3,5,3\n+2.5e2,4,4\n")
    assert [r.arrival_s for r in load_trace(str(p), None, max_model_len=64)] == [0.0, -750.0]
