"""``attnplug explain --svg / --html``: the pictures match the step's arrays (parsed back with
xml.etree), on the seed's worked example and on a full + sliding-window + Mamba config; and
the HTML page renders in headless Chromium when one is installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from attnplug.runner.commands.explain import main
from attnplug.runner.commands.explain_svg import PALETTE

NS = {"s": "http://www.w3.org/2000/svg"}
SEED = Path(__file__).resolve().parents[3] / "docs" / "examples" / "seed_slot_mapping.jsonl"
HYBRID = [
    {"config": {"block_sizes": [4, 4, 1], "kernel_block_sizes": [2, 4, 1],
                "group_kinds": ["full_attention", "sliding_window", "mamba"], "sliding_windows": [None, 4, None],
                "max_num_reqs": 4, "max_model_len": 32, "max_num_batched_tokens": 16, "num_blocks": 64}},
    {"new": [{"req_id": "A", "prompt_token_ids": list(range(1, 11)), "block_ids": [[1, 2, 3], [1, 2, 3], [1]]},
             {"req_id": "B<&>", "prompt_token_ids": [7, 8, 9, 10, 11, 12], "block_ids": [[4, 5], [4, 5], [2]]}],
     "num_scheduled_tokens": {"A": 10, "B<&>": 3}},
    {"cached": [{"req_id": "A", "new_token_ids": [60], "num_computed_tokens": 10},
                {"req_id": "B<&>", "num_computed_tokens": 3}],
     "num_scheduled_tokens": {"A": 1, "B<&>": 3}},
]


def explain_to(tmp_path: Path, capsys, steps_file: Path) -> tuple[list[dict], ET.Element, str]:
    svg, page = tmp_path / "out.svg", tmp_path / "out.html"
    rc = main([str(steps_file), "--check", "--svg", str(svg), "--html", str(page)])
    out = capsys.readouterr()
    assert rc == 0 and out.err == ""
    return [json.loads(line) for line in out.out.splitlines()], ET.parse(svg).getroot(), page.read_text()


def cells(parent: ET.Element, cls: str) -> list[ET.Element]:
    """The ``<g>`` cells under ``parent`` whose class list holds ``cls``."""
    return [g for g in parent.iter(f"{{{NS['s']}}}g") if cls in g.get("class", "").split()]


def text_of(cell: ET.Element) -> str:
    return cell.find("s:text", NS).text


def check_step(step: dict, picture: ET.Element, colours: dict[str, str], kinds: list[str]) -> None:
    """Every token, slot, block-table cell and discard mark of ``step`` is in ``picture``."""
    for rid in step["req_ids"]:
        colours.setdefault(rid, PALETTE[len(colours) % len(PALETTE)])
    qsl, Q = step["query_start_loc"], step["num_actual_tokens"]
    owner = [rid for i, rid in enumerate(step["req_ids"]) for _ in range(qsl[i], qsl[i + 1])]
    tokens = cells(picture, "token")
    assert len(tokens) == Q
    for t, cell in enumerate(tokens):
        assert cell.find("s:rect", NS).get("fill") == colours[owner[t]]
        assert text_of(cell) == str(step["input_ids"][t])
    for g, kind in enumerate(kinds):
        table = picture.find(f".//s:g[@class='table'][@data-group='{g}']", NS)
        rows = table.findall("s:g[@class='row']", NS)
        assert [r.get("data-req") for r in rows] == step["req_ids"]
        for row, ids in zip(rows, step["block_table"][g]):
            blocks = cells(row, "block")
            assert [text_of(c) for c in blocks] == [str(b) for b in ids]
            assert [c for c in blocks if "null" in c.get("class").split()] == [c for c, b in zip(blocks, ids)
                                                                               if b == 0]
        slots = picture.find(f".//s:g[@class='slots'][@data-group='{g}']", NS)
        if kind == "mamba":
            assert slots is None
        else:
            assert [text_of(c) for c in cells(slots, "slot")] == [str(s) for s in step["slot_mapping"][g]]
    marks = picture.findall(".//s:text[@class='discard']", NS)
    assert sorted(m.get("data-req") for m in marks) == sorted(
        rid for rid, d in zip(step["req_ids"], step["discard"]) if d)
    samples = picture.findall(".//s:circle[@class='sample']", NS)
    assert len(samples) + len(marks) == len(step["req_ids"])


def test_the_seed_example_is_drawn_token_by_token(tmp_path, capsys):
    steps, svg, page = explain_to(tmp_path, capsys, SEED)
    pictures = svg.findall("s:g[@class='step']", NS)
    assert len(pictures) == len(steps) >= 1
    colours: dict[str, str] = {}
    for step, picture in zip(steps, pictures):
        check_step(step, picture, colours, ["full_attention"])
    assert any(any(s["discard"]) for s in steps)  # the example has a partial prefill: a discard mark
    assert page.count("<svg") == len(steps) and 'class="legend"' in page
    assert "null block" in page and "discarded" in page


def test_sliding_window_and_mamba_groups(tmp_path, capsys):
    f = tmp_path / "hybrid.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in HYBRID) + "\n")
    steps, svg, page = explain_to(tmp_path, capsys, f)
    pictures = svg.findall("s:g[@class='step']", NS)
    colours: dict[str, str] = {}
    for step, picture in zip(steps, pictures):
        check_step(step, picture, colours, ["full_attention", "sliding_window", "mamba"])
    # step 2: A has computed 10 tokens, window 4: positions 0..6 are never read again, so
    # its first sliding-window block (positions 0..3) is freed and the null block stands there
    last = pictures[1].find(".//s:g[@class='table'][@data-group='1']", NS)
    row_a = last.find("s:g[@data-req='A']", NS)
    first = cells(row_a, "block")[0]
    assert {"null", "freed"} <= set(first.get("class").split()) and text_of(first) == "0"
    assert [("freed" in c.get("class")) for c in cells(row_a, "block")] == [True, False, False]
    assert len(last.findall(".//s:rect[@class='window']", NS)) == 2  # one frame per request
    full = pictures[1].find(".//s:g[@class='table'][@data-group='0']", NS)
    assert not cells(full, "freed") and not full.findall(".//s:rect[@class='window']", NS)
    assert steps[0]["discard"] == [False, True]  # B's partial prefill
    assert "B&lt;&amp;&gt;" in page and "B<&>" not in page  # the request id is escaped
    assert "window 4" in page and "mamba, one state slot per request" in page


@pytest.mark.parametrize("windows, field", [([None, 0, None], "config.sliding_windows[1]"),
                                            ([None, 4], "config.sliding_windows"),
                                            ([4, None, None], "sliding_windows [4, None, None]: need")])
def test_bad_sliding_windows_are_one_line_errors(tmp_path, capsys, windows, field):
    cfg = json.loads(json.dumps(HYBRID[0]))
    cfg["config"]["sliding_windows"] = windows
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(cfg) + "\n")
    assert main([str(f), "--svg", str(tmp_path / "x.svg")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and field in err


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(chromium() is None, reason="no chromium binary on PATH")
def test_the_html_page_renders_in_headless_chromium(tmp_path, capsys):
    f = tmp_path / "hybrid.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in HYBRID) + "\n")
    explain_to(tmp_path, capsys, f)
    png = tmp_path / "page.png"
    subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={png}", "--window-size=1100,1500", (tmp_path / "out.html").as_uri()],
                   check=True, capture_output=True, timeout=120)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a blank page compresses far smaller


def test_a_bad_step_keeps_the_steps_before_it_and_an_unwritable_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in HYBRID + [{"bogus": 1}]) + "\n")
    svg = tmp_path / "out.svg"
    assert main([str(f), "--svg", str(svg)]) == 2
    assert "step 3 (line 4): field 'bogus'" in capsys.readouterr().err
    assert len(ET.parse(svg).getroot().findall("s:g[@class='step']", NS)) == 2
    assert main([str(SEED), "--html", str(tmp_path / "no" / "such" / "dir.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnplug explain: cannot write")
