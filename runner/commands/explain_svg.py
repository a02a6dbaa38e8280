"""Pictures of ``attnplug explain``'s steps: ``--svg OUT.svg`` and ``--html OUT.html``.

Each step is drawn from its output object (``explain.step_to_json``) and the cache groups'
facts (kind, block size, kernel block size, window), top to bottom:

* ``tokens``: the flat token stream, one rect per token in its request's colour (input id,
  position); under it one band per request (``c`` computed, ``q`` scheduled) and the
  sampled token of each request, marked ``×`` where the row's logits are discarded;
* ``slots gG``: per paged group, each token's slot (``kernel block + offset`` under it);
* ``group G``: the block table, one row per request, one cell per kernel block id. Block 0
  (the null block) is grey; in a sliding-window group the blocks wholly before the first
  key a query of the step can see are "freed" (dashed, crossed), and a dashed frame shows
  the keys the step's queries see; the cells this step writes have a thick border.

Built with :mod:`xml.etree.ElementTree` (text and attributes escaped by it); colours are
attributes, not CSS, so the SVG reads the same in any viewer. Very large steps are cut to
:data:`MAX_TOKENS` tokens, :data:`MAX_ROWS` rows and :data:`MAX_CELLS` cells a row, and
the picture says so.
"""

from __future__ import annotations

import html
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any, Sequence

from attnplug.cache_groups.kinds import GroupKind

SVG_NS = "http://www.w3.org/2000/svg"
MAX_TOKENS = 256
"""Most tokens drawn per step."""
MAX_ROWS = 64
"""Most requests (block-table rows) drawn per step."""
MAX_CELLS = 128
"""Most block-table cells drawn per row."""
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#86bcb6")
"""Request colours, in order of first appearance (then again from the start)."""
NULL_FILL = "#d0d0d0"
FREED_STROKE = "#c03030"
WINDOW_STROKE = "#1f5fbf"
DISCARD_FILL = "#c03030"
LEFT, CW, CH, GAP = 130, 38, 30, 14
"""Left margin (labels), cell width, cell height, gap between sections (px)."""


@dataclass(frozen=True)
class GroupView:
    """What the picture needs to know of one cache group."""

    kind: str
    block_size: int
    kernel_block_size: int
    sliding_window: int | None = None


def group_views(sc: Any) -> list[GroupView]:
    """The :class:`GroupView` of every group of a ``StepCompiler``."""
    return [GroupView(str(k), int(b), int(kb), w) for k, b, kb, w in
            zip(sc.group_kinds, sc.block_sizes, sc.kernel_block_sizes, sc.sliding_windows)]


def _short(text: str, n: int = 12) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


class _Canvas:
    """One step's SVG elements and running height."""

    def __init__(self, parent: ET.Element):
        self.root, self.y, self.width = parent, 0, LEFT

    def el(self, tag: str, parent: ET.Element | None = None, text: str | None = None, **attrs) -> ET.Element:
        e = ET.SubElement(self.root if parent is None else parent, tag,
                          {k.rstrip("_").replace("_", "-"): str(v) for k, v in attrs.items()})
        if text is not None:
            e.text = text
        return e

    def label(self, y: float, text: str, **attrs) -> None:
        self.el("text", text=text, x=8, y=y + CH / 2 + 4, font_size=12, font_family="sans-serif", **attrs)

    def cell(self, x: float, y: float, cls: str, fill: str, lines: Sequence[str], title: str | None = None,
             w: float = CW, **attrs) -> ET.Element:
        g = self.el("g", class_=cls)
        if title:
            self.el("title", g, title)
        self.el("rect", g, x=x, y=y, width=w, height=CH, fill=fill, stroke="#333", stroke_width=1, **attrs)
        sizes = (12, 8)
        for k, line in enumerate(lines[:2]):
            self.el("text", g, line, x=x + w / 2, y=y + (12 if len(lines) > 1 else 19) + 11 * k,
                    font_size=sizes[k], text_anchor="middle", font_family="monospace")
        self.width = max(self.width, x + w + 10)
        return g


class StepPicture:
    """Draws steps; a request keeps its colour over the steps drawn by one picture."""

    def __init__(self, groups: Sequence[GroupView]):
        self.groups = list(groups)
        self.colours: dict[str, str] = {}

    def colour(self, rid: str) -> str:
        if rid not in self.colours:
            self.colours[rid] = PALETTE[len(self.colours) % len(PALETTE)]
        return self.colours[rid]

    def draw(self, step: dict, number: int, parent: ET.Element) -> tuple[float, float]:
        """Draw step ``number`` into ``parent``; return its (width, height)."""
        cv = _Canvas(parent)
        R, Q = len(step["req_ids"]), step["num_actual_tokens"]
        title = (f"step {number}: {R} requests, {Q} tokens, max_query_len {step['max_query_len']}, "
                 f"max_seq_len {step['max_seq_len']}")
        cv.el("text", text=title, x=8, y=18, font_size=14, font_weight="bold", font_family="sans-serif",
              class_="title")
        cv.width = max(cv.width, 16 + 8.5 * len(title))  # bold 14 px sans-serif: under 8.5 px a character
        cv.y = 30
        owner = self._token_rows(step, cv)
        for g, view in enumerate(self.groups):
            if view.kind != GroupKind.MAMBA:
                self._slots(step, g, view, owner, cv)
        for g, view in enumerate(self.groups):
            self._table(step, g, view, cv)
        return cv.width, cv.y + 10

    def _token_rows(self, step: dict, cv: _Canvas) -> list[int]:
        qsl, R = step["query_start_loc"], len(step["req_ids"])
        Q = step["num_actual_tokens"]
        shown = min(Q, MAX_TOKENS)
        owner = [0] * Q
        for i in range(R):
            for t in range(qsl[i], min(qsl[i + 1], Q)):
                owner[t] = i
        y = cv.y
        cv.label(y, "tokens")
        for t in range(shown):
            rid = step["req_ids"][owner[t]]
            cv.cell(LEFT + t * CW, y, "token", self.colour(rid),
                    [str(step["input_ids"][t]), f"p{step['positions'][t]}"],
                    title=f"token {t}: request {rid}, position {step['positions'][t]}, "
                          f"input id {step['input_ids'][t]}", data_req=rid)
        if shown < Q:
            cv.el("text", text=f"… {Q - shown} more tokens not drawn", x=LEFT + shown * CW + 6, y=y + 19,
                  font_size=11, font_family="sans-serif", class_="cut")
        y += CH + 4
        cv.label(y, "requests")
        for i in range(min(R, MAX_ROWS)):
            a, b = qsl[i], min(qsl[i + 1], shown)
            if b <= a:
                continue
            rid, c, q = step["req_ids"][i], step["num_computed_tokens"][i], step["num_scheduled_tokens"][i]
            text = f"{_short(rid)} c={c} q={q}"
            if len(text) * 7.5 > (b - a) * CW:  # monospace 12 px: about 7.2 px a character
                text = _short(rid, max(1, int((b - a) * CW / 7.5)))
            cv.cell(LEFT + a * CW, y, "request", self.colour(rid), [text],
                    w=(b - a) * CW, title=f"request {rid}: {c} computed, {q} scheduled", fill_opacity=0.5)
        y += CH + 4
        cv.label(y, "logits")
        for i, t in enumerate(step["logits_indices"][:MAX_ROWS]):
            if t >= shown:
                continue
            x, rid = LEFT + t * CW + CW / 2, step["req_ids"][i]
            if step["discard"][i]:
                cv.el("text", text="×", x=x, y=y + 20, font_size=20, text_anchor="middle", fill=DISCARD_FILL,
                      class_="discard", data_req=rid)
            else:
                cv.el("circle", cx=x, cy=y + CH / 2, r=6, fill=self.colour(rid), stroke="#333", class_="sample",
                      data_req=rid)
        cv.y = y + CH + GAP
        return owner

    def _slots(self, step: dict, g: int, view: GroupView, owner: list[int], cv: _Canvas) -> None:
        k = view.kernel_block_size
        y, outer = cv.y, cv.root
        cv.root = cv.el("g", class_="slots", data_group=g)
        cv.label(y, f"slots g{g}")
        for t, slot in enumerate(step["slot_mapping"][g][:MAX_TOKENS]):
            rid = step["req_ids"][owner[t]]
            if slot < 0:
                lines, title = ["pad", ""], f"token {t}: padding slot {slot}"
            else:
                lines = [str(slot), f"{slot // k}+{slot % k}"]
                title = f"token {t}: slot {slot} = kernel block {slot // k} * {k} + {slot % k}"
            cv.cell(LEFT + t * CW, y, "slot", self.colour(rid), lines[:2] if lines[1] else lines[:1],
                    title=title, fill_opacity=0.35, data_req=rid)
        cv.y, cv.root = y + CH + GAP / 2, outer

    def _table(self, step: dict, g: int, view: GroupView, cv: _Canvas) -> None:
        k, outer = view.kernel_block_size, cv.root
        cv.root = cv.el("g", class_="table", data_group=g, data_kind=view.kind)
        head = f"group {g}: {view.kind}" + (f", block size {view.block_size}" if view.kind != GroupKind.MAMBA else "")
        if k != view.block_size and view.kind != GroupKind.MAMBA:
            head += f" (kernel {k})"
        if view.sliding_window is not None:
            head += f", window {view.sliding_window}"
        if view.kind == GroupKind.MAMBA:
            head += ", one state slot per request"
        cv.el("text", text=head, x=8, y=cv.y + 12, font_size=12, font_weight="bold", font_family="sans-serif",
              class_="group-title")
        y, table = cv.y + 18, cv.root
        written: set[int] = set()
        if view.kind != GroupKind.MAMBA:
            written = {s // k for s in step["slot_mapping"][g] if s >= 0}
        rows = step["block_table"][g]
        for i, row in enumerate(rows[:MAX_ROWS]):
            rid, c = step["req_ids"][i], step["num_computed_tokens"][i]
            cv.root = cv.el("g", class_="row", data_req=rid)
            self._row_label(cv, y, rid)
            dead = 0
            if view.sliding_window is not None:
                dead = max(0, c - view.sliding_window + 1)  # tokens no query of the step sees
            for j, bid in enumerate(row[:MAX_CELLS]):
                x, cls, attrs = LEFT + j * CW, ["block"], {}
                fill = "#ffffff"
                if bid == 0:
                    cls.append("null")
                    fill = NULL_FILL
                if dead and (j + 1) * k <= dead:
                    cls.append("freed")
                    attrs = dict(stroke_dasharray="4 3")
                if bid in written and bid != 0:
                    cls.append("written")
                what = {"null": "the null block", "freed": "freed by the window"}
                notes = ", ".join(what[n] for n in cls[1:] if n in what)
                span = f"positions {j * k}..{j * k + k - 1}" if view.kind != GroupKind.MAMBA else "state slot"
                gcell = cv.cell(x, y, " ".join(cls), fill, [str(bid)],
                                title=f"request {rid}, column {j} ({span}): block {bid}" + (f" ({notes})" if notes
                                                                                           else ""), **attrs)
                if "written" in cls:
                    cv.el("rect", gcell, x=x + 2, y=y + 2, width=CW - 4, height=CH - 4, fill="none",
                          stroke=self.colour(rid), stroke_width=3)
                if "freed" in cls:
                    cv.el("line", gcell, x1=x, y1=y, x2=x + CW, y2=y + CH, stroke=FREED_STROKE, stroke_width=1.5)
            if len(row) > MAX_CELLS:
                cv.el("text", text=f"… {len(row) - MAX_CELLS} more", x=LEFT + MAX_CELLS * CW + 6, y=y + 19,
                      font_size=11, font_family="sans-serif", class_="cut")
            if view.sliding_window is not None:
                end = step["seq_lens"][i]
                x0, x1 = LEFT + dead / k * CW, LEFT + min(end / k, MAX_CELLS) * CW
                cv.el("rect", x=x0, y=y - 3, width=max(x1 - x0, 2), height=CH + 6, fill="none",
                      stroke=WINDOW_STROKE, stroke_width=2, stroke_dasharray="6 3", class_="window",
                      data_req=rid)
            y += CH + 6
            cv.root = table
        if len(rows) > MAX_ROWS:
            cv.el("text", text=f"… {len(rows) - MAX_ROWS} more requests not drawn", x=LEFT, y=y + 12,
                  font_size=11, font_family="sans-serif", class_="cut")
            y += 18
        cv.y, cv.root = y + GAP, outer

    def _row_label(self, cv: _Canvas, y: float, rid: str) -> None:
        cv.el("rect", x=8, y=y + 8, width=14, height=14, fill=self.colour(rid), stroke="#333", class_="swatch")
        cv.el("text", text=_short(rid), x=28, y=y + CH / 2 + 4, font_size=12, font_family="monospace")


def _svg(width: float, height: float) -> ET.Element:
    return ET.Element("svg", {"xmlns": SVG_NS, "width": f"{width:.0f}", "height": f"{height:.0f}",
                              "viewBox": f"0 0 {width:.0f} {height:.0f}"})


def step_svgs(steps: Sequence[dict], groups: Sequence[GroupView]) -> list[ET.Element]:
    """One ``<svg>`` element per step (request colours shared over the steps)."""
    pic, out = StepPicture(groups), []
    for n, step in enumerate(steps, 1):
        holder = ET.Element("g", {"class": "step", "data-step": str(n)})
        w, h = pic.draw(step, n, holder)
        svg = _svg(w, h)
        svg.append(holder)
        out.append(svg)
    return out


def render_svg(steps: Sequence[dict], groups: Sequence[GroupView]) -> str:
    """One SVG document: every step, stacked top to bottom."""
    pic, parts, y, width = StepPicture(groups), [], 0.0, 200.0
    for n, step in enumerate(steps, 1):
        holder = ET.Element("g", {"class": "step", "data-step": str(n), "transform": f"translate(0 {y:.0f})"})
        w, h = pic.draw(step, n, holder)
        parts.append(holder)
        y, width = y + h + 20, max(width, w)
    svg = _svg(width, max(y, 20))
    svg.extend(parts)
    return ET.tostring(svg, encoding="unicode")


LEGEND = (("token", "a token (input id, position p), in its request's colour", "background:#4e79a7"),
          ("sampled", "the token whose logits are sampled (●) or discarded (×: a partial prefill)",
           "background:#fff;border-radius:50%"),
          ("slot", "slot = kernel block × kernel block size + offset (shown as block+offset)",
           "background:#4e79a7;opacity:.35"),
          ("null", "block 0, the null block: no K/V of the request is there", f"background:{NULL_FILL}"),
          ("freed", "a sliding-window block no query of the step can see (freed; dashed, crossed)",
           f"background:#fff;border-style:dashed;border-color:{FREED_STROKE}"),
          ("window", "the keys the step's queries see in a sliding-window group",
           f"background:#fff;border:2px dashed {WINDOW_STROKE}"),
          ("written", "a block this step writes K/V into (thick border)", "background:#fff;border:3px solid #4e79a7"))


def render_html(steps: Sequence[dict], groups: Sequence[GroupView], title: str = "attnplug explain") -> str:
    """A standalone HTML page: a legend, then one SVG per step."""
    items = "\n".join(f'<li><span class="key" style="{style}"></span><b>{html.escape(name)}</b>: '
                      f"{html.escape(text)}</li>" for name, text, style in LEGEND)
    kinds = ", ".join(f"g{g}: {html.escape(v.kind)}" for g, v in enumerate(groups))
    body = "\n".join(f'<section id="step-{n}">{ET.tostring(svg, encoding="unicode")}</section>'
                     for n, svg in enumerate(step_svgs(steps, groups), 1))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;margin:16px;color:#222}"
            ".key{display:inline-block;width:14px;height:14px;border:1px solid #333;margin-right:6px;"
            "vertical-align:middle}ul.legend{list-style:none;padding:0;font-size:13px}"
            "section{margin:12px 0;overflow-x:auto}</style></head><body>\n"
            f"<h1>{html.escape(title)}</h1><p>{len(steps)} step{'' if len(steps) == 1 else 's'}; "
            f"cache groups {kinds}</p>\n"
            f'<ul class="legend">{items}</ul>\n{body}\n</body></html>\n')


class Pictures:
    """Collects steps while ``explain`` runs (``on_step``), then writes the files."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.groups: list[GroupView] = []

    def on_step(self, sc: Any, step: dict) -> None:
        if not self.groups:
            self.groups = group_views(sc)
        self.steps.append(step)

    def write(self, svg_path: str | None, html_path: str | None, title: str = "attnplug explain") -> None:
        """Write the SVG and / or HTML file (``OSError`` passes through)."""
        if svg_path:
            with open(svg_path, "w", encoding="utf-8") as f:
                f.write(render_svg(self.steps, self.groups))
        if html_path:
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(render_html(self.steps, self.groups, title))
