"""Figures for a paper: the charts of :mod:`attnres_probe.figures` laid out for print, and written
as SVG, PDF or 300 dpi PNG through one Chromium (kaleido).

    from attnres_probe import exports
    figs = exports.standard_figures(traces, size="double")          # name -> print-ready figure
    exports.write_images({f"figs/{n}.svg": f for n, f in figs.items()})

A chart of :mod:`attnres_probe.figures` is drawn for a screen (a 1100 px page, 12-17 px fonts);
at a column's width its labels run together. :func:`for_print` lays a figure out again for a
page width (:data:`PAPER_WIDTH_IN`: a single column, 3.3 in, or a double column, 7 in):

- one layout pixel is one CSS pixel, 1/96 in, so an SVG or PDF is exactly the column wide, and a
  PNG is rendered at :data:`DPI` (and says so in its ``pHYs`` chunk);
- fonts in points (:class:`PrintFonts`: 7 pt tick labels, 8 pt labels, 9 pt title), Arial or
  Helvetica (Liberation Sans where neither is installed: the same widths);
- every text is measured with Helvetica's advance widths (:func:`text_width`) and the margins,
  the gaps between panels and the room above each panel are sized to what they hold: titles and
  subplot titles are wrapped to their width; category ticks are kept horizontal where they fit,
  turned upright where they do not, and thinned to every 2nd, 3rd... label where even upright
  ones would touch; log axes get full-number ticks spaced for the panel's height; a panel whose
  y labels repeat its left neighbour's drops them;
- a row of panels too narrow for the width (magnitudes at a single column) is stacked into a
  column; the legend goes under the plot, horizontal; legend-only lines are left out (print has
  no clicks).

:func:`standard_figures` is the set ``attnres-probe figures`` writes; :func:`write_images` writes
figures with one kaleido process (starting one costs seconds; each image then well under one).
"""

from __future__ import annotations

import asyncio
import copy
import html
import math
import re
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from attnres_probe.analysis.windows import informative_token

__all__ = [
    "DPI",
    "FORMATS",
    "PAPER_WIDTH_IN",
    "SIZES",
    "PrintFonts",
    "for_print",
    "paper_width_px",
    "standard_figures",
    "standard_stems",
    "text_width",
    "write_images",
]

PAPER_WIDTH_IN = {"single": 3.3, "double": 7.0}  # a column of a two-column paper; the full text width
SIZES = tuple(PAPER_WIDTH_IN)
FORMATS = ("svg", "png", "pdf")
DPI = 300  # raster output (PNG)
CSS_DPI = 96  # layout pixels per inch: an SVG's px and the PDF page (Chromium prints 96 px to the inch)
FONT_FAMILY = "Arial, Helvetica, 'Liberation Sans', sans-serif"


@dataclass(frozen=True)
class PrintFonts:
    """Font sizes in points."""

    title: float = 9.0  # the figure's title
    label: float = 8.0  # subplot titles, axis titles
    tick: float = 7.0  # tick labels, colour-bar ticks and title, legend, notes


FONTS = PrintFonts()


def pt(points: float) -> float:
    """Points in layout pixels (1 pt = 1/72 in, 1 px = 1/96 in)."""
    return points * CSS_DPI / 72


def paper_width_px(size: str) -> int:
    """The width of a ``"single"`` or ``"double"`` column in layout pixels (1/96 in)."""
    if size not in PAPER_WIDTH_IN:
        raise ValueError(f"size is {size!r}; accepted sizes are {', '.join(SIZES)} "
                         f"({', '.join(f'{v} in' for v in PAPER_WIDTH_IN.values())} wide)")
    return round(PAPER_WIDTH_IN[size] * CSS_DPI)


# -- measuring text ---------------------------------------------------------------------------
# Helvetica's (= Arial's, Liberation Sans's) advance widths of the printable ASCII characters, in
# 1/1000 em, measured in Chromium; other characters count as the widest common glyphs.
_ASCII_WIDTHS = (
    278, 278, 355, 556, 556, 889, 667, 191, 333, 333, 389, 584, 278, 333, 278, 278, 556, 556, 556, 556, 556, 556, 556,
    556, 556, 556, 278, 278, 584, 584, 584, 556, 1015, 667, 667, 722, 722, 667, 611, 778, 722, 278, 500, 667, 556, 833,
    722, 778, 667, 778, 722, 667, 611, 722, 667, 944, 667, 667, 611, 278, 278, 278, 469, 556, 333, 556, 556, 500, 556,
    556, 278, 556, 556, 222, 222, 500, 222, 833, 556, 556, 556, 556, 333, 500, 278, 556, 500, 722, 500, 500, 500, 334,
    260, 334, 584,
)
_OTHER_WIDTH = 900  # non-ASCII (α, ‖, ∂, −, ↵ ...): Helvetica or a fallback font, counted wide
_TAG = re.compile(r"<[^>]*>")
_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)
LINE = 1.3  # plotly's line spacing in multi-line text (em)
BOX = 1.2  # the height of one line's box (ascent + descent, em)


def _plain(text: str) -> str:
    return html.unescape(_TAG.sub("", text))


def text_width(text: str, size_px: float) -> float:
    """The width in px of one line of ``text`` (HTML tags left out) at ``size_px``."""
    total = 0
    for ch in _plain(text):
        o = ord(ch)
        total += _ASCII_WIDTHS[o - 32] if 32 <= o < 127 else _OTHER_WIDTH
    return total * size_px / 1000


def wrap(text: str, width_px: float, size_px: float) -> tuple[str, int]:
    """``text`` wrapped at spaces so that no line is wider than ``width_px``; its ``<br>`` kept.
    Returns the text and its number of lines."""
    out: list[str] = []
    for line in _BR.split(text or ""):
        current = ""
        for word in _split_long(line.split(" "), width_px, size_px):
            candidate = f"{current} {word}" if current else word
            if current and text_width(candidate, size_px) > width_px:
                out.append(current)
                current = word
            else:
                current = candidate
        out.append(current)
    return "<br>".join(out), len(out)


def _split_long(words: list[str], width_px: float, size_px: float) -> list[str]:
    """Words wider than ``width_px`` (a long model name) cut into pieces that fit (no tags in a piece cut)."""
    out = []
    for word in words:
        if "<" in word or text_width(word, size_px) <= width_px:
            out.append(word)
            continue
        piece = ""
        for ch in word:
            if piece and text_width(piece + ch, size_px) > width_px:
                out.append(piece)
                piece = ""
            piece += ch
        out.append(piece)
    return out


def _lines_px(n: int, size_px: float) -> float:
    """The height of ``n`` lines of text."""
    return 0.0 if n <= 0 else (n - 1) * LINE * size_px + BOX * size_px


def _small_spans(text: str) -> str:
    """A title's inline ``font-size:12px`` spans at the print tick size."""
    return re.sub(r"font-size:\s*[\d.]+px", f"font-size:{pt(FONTS.tick):.1f}px", text)


# -- the layout ---------------------------------------------------------------------------------
PAD = 4  # px at the figure's edges
PANEL_GAP = 10  # px between panels beside their labels
TICK_LEN = 3
TICK_GAP = 3  # px between a tick and its label
ROW_PX = 12  # one category of a heatmap's y axis
MIN_PANEL_PX = 150  # a row of panels narrower than this each is stacked into a column
COLORBAR_PX = 8
LEGEND_SYMBOL_PX = 45  # a legend item's line sample and padding
LEGEND_ROW_PX = 19  # plotly: max(line height, 16) + 3


def _ref_key(ref: str) -> str:
    """"x2" -> "xaxis2"."""
    return f"{ref[0]}axis{ref[1:]}"


def _array(values: Any) -> np.ndarray:
    """A trace's data array as numpy: plotly's JSON keeps numeric arrays base64-packed
    (``{"dtype": "f8", "bdata": ..., "shape": "17, 17"}``)."""
    if isinstance(values, dict) and "bdata" in values:
        import base64

        arr = np.frombuffer(base64.b64decode(values["bdata"]), dtype=np.dtype(values["dtype"]))
        shape = values.get("shape")
        if shape:
            arr = arr.reshape([int(s) for s in str(shape).split(",")])
        return arr.astype(np.float64)
    return np.asarray(values, dtype=np.float64)


def _strings(values: Any) -> list[str] | None:
    """``values`` as strings when they are categories (every value a string), else None."""
    if values is None or isinstance(values, dict):
        return None
    vals = list(np.asarray(values, dtype=object).ravel()) if isinstance(values, np.ndarray) else list(values)
    if vals and all(isinstance(v, str) for v in vals):
        return vals
    return None


@dataclass
class _Axis:
    key: str  # "xaxis2"
    letter: str  # "x" or "y"
    ax: dict  # the layout's axis dict (edited in place)
    traces: list[dict]
    length: float = 0.0  # px along the axis
    labels: list[str] | None = None  # every label that could be drawn (before thinning)
    shown: list[str] | None = None  # those drawn
    angle: int = 0
    kind: str = "category"  # "category" (labels from the figure), "log" or "linear" (ticks chosen here)
    wrapped: str | None = None  # the title wrapped to the axis's length
    title_lines: int = 0

    @property
    def visible(self) -> bool:
        return self.ax.get("showticklabels", True) is not False and self.ax.get("visible", True) is not False

    def title(self) -> str:
        t = self.ax.get("title")
        return (t.get("text") if isinstance(t, dict) else t) or ""


@dataclass
class _Panel:
    x: _Axis
    y: _Axis
    xdom: tuple[float, float]
    ydom: tuple[float, float]
    row: int = 0
    col: int = 0
    heat: bool = False
    subtitle: dict | None = None
    subtitle_lines: int = 0


def _panels(layout: dict, data: list[dict]) -> list[_Panel]:
    pairs: list[tuple[str, str]] = []
    for tr in data:
        pair = (tr.get("xaxis") or "x", tr.get("yaxis") or "y")
        if pair not in pairs:
            pairs.append(pair)
    used = {p[0] for p in pairs}
    for key in sorted(k for k in layout if re.fullmatch(r"xaxis\d*", k)):
        x = "x" + key[5:]
        anchor = layout[key].get("anchor")
        if x not in used:
            pairs.append((x, anchor if anchor and anchor.startswith("y") else "y" + key[5:]))
            used.add(x)
    if not pairs:
        pairs = [("x", "y")]
    panels = []
    for x, y in pairs:
        traces = [tr for tr in data if (tr.get("xaxis") or "x") == x and (tr.get("yaxis") or "y") == y]
        xa = layout.setdefault(_ref_key(x), {})
        ya = layout.setdefault(_ref_key(y), {})
        panels.append(_Panel(
            _Axis(_ref_key(x), "x", xa, traces), _Axis(_ref_key(y), "y", ya, traces),
            tuple(xa.get("domain") or (0.0, 1.0)), tuple(ya.get("domain") or (0.0, 1.0)),
            heat=any(tr.get("type") == "heatmap" for tr in traces),
        ))
    return panels


def _grid(panels: list[_Panel], plot_w: float) -> tuple[int, int]:
    """Give each panel its row (top first) and column; a single row too narrow for the width wraps
    into rows of as many panels as fit (at least :data:`MIN_PANEL_PX` each), left to right, so that
    six models at double width take two rows of three, not a column of six. Returns (rows, columns)."""
    tops = sorted({round(p.ydom[1], 4) for p in panels}, reverse=True)
    lefts = sorted({round(p.xdom[0], 4) for p in panels})
    for p in panels:
        p.row, p.col = tops.index(round(p.ydom[1], 4)), lefts.index(round(p.xdom[0], 4))
    rows, cols = len(tops), len(lefts)
    if rows == 1 and cols > 1 and plot_w / cols < MIN_PANEL_PX:
        per_row = max(1, int(plot_w // MIN_PANEL_PX))
        for i, p in enumerate(sorted(panels, key=lambda q: q.col)):
            p.row, p.col = divmod(i, per_row)
        rows, cols = -(-cols // per_row), min(per_row, cols)
    return rows, cols


def _subtitles(layout: dict, panels: list[_Panel]) -> None:
    """Find each panel's subplot title (make_subplots' annotation centred above its domain)."""
    for ann in layout.get("annotations") or []:
        if ann.get("xref", "paper") != "paper" or ann.get("yref", "paper") != "paper" or ann.get("yanchor") != "bottom":
            continue
        for p in panels:
            if p.subtitle is None and abs(ann.get("x", -1) - sum(p.xdom) / 2) < 1e-3 and abs(ann.get("y", -1) - p.ydom[1]) < 1e-3:
                p.subtitle = ann
                break


def _category_labels(axis: _Axis) -> None:
    """The labels ``axis`` can draw: an explicit tick array's, or its categories (string data)."""
    ax = axis.ax
    if ax.get("tickmode") == "array" and ax.get("tickvals") is not None:
        vals = list(ax["tickvals"])
        text = list(ax.get("ticktext") or vals)
        axis.labels = [str(t) for t in text]
        ax["_vals"] = vals
        return
    cats: list[str] = []
    for tr in axis.traces:
        vals = _strings(tr.get(axis.letter))
        if vals:
            cats += [v for v in vals if v not in cats]
    if cats:
        axis.labels = cats
        ax["_vals"] = cats


def _thin(n: int, spacing: float, need: float) -> int:
    """Every how many labels to draw so that neighbours ``need`` px apart fit ``spacing`` px per label."""
    return max(1, math.ceil(need / max(spacing, 1e-6)))


def _decide_x(axis: _Axis, tick_px: float) -> None:
    """Horizontal labels where they fit (thinned if need be), else upright ones (thinned)."""
    if not axis.labels or axis.kind != "category":
        return
    n = len(axis.labels)
    spacing = axis.length / n
    widest = max(text_width(t, tick_px) for t in axis.labels)
    flat = _thin(n, spacing, widest + 4)
    upright = _thin(n, spacing, BOX * tick_px + 2)
    if flat == 1 or flat <= upright:
        axis.angle, step = 0, flat
    else:
        axis.angle, step = -90, upright
    axis.shown = axis.labels[::step]
    axis.ax["_step"] = step


def _x_depth(axis: _Axis, tick_px: float) -> float:
    """How far an x axis's tick labels reach below the plot."""
    if not axis.visible:
        return TICK_LEN
    shown = axis.shown if axis.shown is not None else axis.labels
    if shown is None:  # plotly's own ticks: numbers, one line
        return TICK_LEN + TICK_GAP + BOX * tick_px
    if axis.angle == 0:
        return TICK_LEN + TICK_GAP + BOX * tick_px
    return TICK_LEN + TICK_GAP + max((text_width(t, tick_px) for t in shown), default=0)


def _x_overhang(axis: _Axis, tick_px: float) -> tuple[float, float]:
    """How far horizontal x labels reach past the panel's left and right edges."""
    if not axis.visible or axis.angle != 0 or not axis.shown or axis.kind != "category":
        return 0.0, 0.0
    n, step = len(axis.labels), axis.ax.get("_step", 1)
    spacing = axis.length / n
    first = text_width(axis.shown[0], tick_px) / 2 - spacing / 2
    last_index = (len(axis.shown) - 1) * step
    last = text_width(axis.shown[-1], tick_px) / 2 - (n - last_index - 0.5) * spacing
    return max(0.0, first), max(0.0, last)


def _nice(v: float) -> str:
    return f"{v:.3g}".replace("-", "−")


def _log_ticks(axis: _Axis, tick_px: float) -> None:
    """Full-number ticks of a log axis spaced at least one label apart over ``axis.length`` px:
    1-2-5 in each decade, else 1-3, else powers of ten (every 1, 2, 5... decades); the range set
    to the data's."""
    values = []
    for tr in axis.traces:
        v = tr.get(axis.letter)
        if v is not None:
            a = _array(v).ravel()
            values.append(a[np.isfinite(a) & (a > 0)])
    v = np.concatenate(values) if values else np.array([])
    if not v.size:
        return
    lo, hi = math.log10(float(v.min())), math.log10(float(v.max()))
    pad = max(0.04 * (hi - lo), 0.03)
    r0, r1 = lo - pad, hi + pad
    axis.ax.update(range=[r0, r1], autorange=False)
    per_decade = axis.length / (r1 - r0)
    need = BOX * tick_px + 3
    for mantissas, every in (((1, 2, 5), 1), ((1, 3), 1), ((1,), 1), ((1,), 2), ((1,), 5), ((1,), 10)):
        ticks = [m * 10.0 ** k for k in range(math.floor(r0) - 1, math.ceil(r1) + 1) if k % every == 0 for m in mantissas]
        ticks = [t for t in ticks if r0 <= math.log10(t) <= r1]
        gaps = np.diff(np.log10(ticks)) * per_decade if len(ticks) > 1 else np.array([np.inf])
        if len(ticks) >= 2 and gaps.min() >= need:
            break
    else:
        ticks = []
    if len(ticks) < 2:  # less than a decade and too short for 1-2-5: two or three values in between
        k = max(2, min(3, int(axis.length // (2 * need)) + 1))
        ticks = [float(f"{t:.2g}") for t in 10 ** np.linspace(lo, hi, k)]
        ticks = sorted(set(ticks))
    text = [_nice(t) for t in ticks]
    axis.ax.update(tickmode="array", tickvals=ticks, ticktext=text, minor={"showgrid": False, "ticks": ""})
    axis.ax.pop("dtick", None)
    axis.labels = axis.shown = text


def _numeric_ticks(axis: _Axis, tick_px: float) -> None:
    """plotly's own ticks on a linear axis, no more than fit; the labels estimated from the data."""
    values = []
    for tr in axis.traces:
        v = tr.get(axis.letter)
        if v is not None and _strings(v) is None:
            try:
                a = _array(v).ravel()
            except (TypeError, ValueError):
                continue
            values.append(a[np.isfinite(a)])
    v = np.concatenate(values) if values else np.array([0.0, 1.0])
    if not v.size:
        v = np.array([0.0, 1.0])
    sample = [_nice(float(v.min())), _nice(float(v.max())), "0.00"]
    widest = max(text_width(s, tick_px) for s in sample)
    if axis.letter == "x":
        axis.ax["nticks"] = max(2, int(axis.length // (widest + 12)))
    else:
        axis.ax["nticks"] = max(2, int(axis.length // (3 * BOX * tick_px)))
    axis.labels = axis.shown = sample


def _y_width(axis: _Axis, tick_px: float) -> float:
    if not axis.visible:
        return 0.0
    shown = axis.shown if axis.shown is not None else axis.labels
    return max((text_width(t, tick_px) for t in shown or ["0.00"]), default=0.0)


def _wrap_title(axis: _Axis, length: float, label_px: float) -> float:
    """Wrap the axis's title to ``length`` px; the room it takes across the axis."""
    t = axis.title()
    if not t or not axis.visible:
        axis.wrapped, axis.title_lines = "", 0
        return 0.0
    axis.wrapped, axis.title_lines = wrap(t, length, label_px)
    return _lines_px(axis.title_lines, label_px) + 4


def _rows_px(p: "_Panel") -> float:
    """A panel's height before the layout is settled: its heatmap rows, else the least a line chart gets."""
    if p.heat and p.y.labels:
        return len(p.y.labels) * ROW_PX
    return 110.0


def _style_axis(axis: _Axis, tick_px: float, label_px: float) -> None:
    """Print styling of an axis; its category ticks thinned to every ``_step``-th."""
    ax = axis.ax
    vals, step = ax.pop("_vals", None), ax.pop("_step", 1)
    if vals is not None and axis.labels is not None and axis.kind == "category":
        ax.update(tickmode="array", tickvals=list(vals)[::step], ticktext=list(axis.labels)[::step])
    if axis.letter == "x":
        ax["tickangle"] = axis.angle
    ax.update(tickfont={"size": tick_px}, ticks="outside", ticklen=TICK_LEN, tickwidth=0.8, automargin=False,
              showline=True, linecolor="#444", linewidth=0.8, mirror=False, zeroline=False)
    t = axis.wrapped if axis.wrapped is not None else axis.title()
    if t and axis.visible:
        ax["title"] = {"text": t, "font": {"size": label_px}, "standoff": 3}
    else:
        ax["title"] = {"text": ""}


def _colorbar_px(traces: list[dict], tick_px: float, label_px: float) -> float:
    """The width a heatmap colour bar takes right of the plot."""
    widest = 0.0
    for tr in traces:
        lo, hi = tr.get("zmin"), tr.get("zmax")
        z = _array(tr.get("z") if tr.get("z") is not None else [0.0])
        finite = z[np.isfinite(z)]
        lo = float(lo) if lo is not None else float(finite.min()) if finite.size else 0.0
        hi = float(hi) if hi is not None else float(finite.max()) if finite.size else 1.0
        m = max(abs(lo), abs(hi))
        digits = "0" * max(1, len(str(int(m)))) + ".00"
        widest = max(widest, text_width(("−" if lo < 0 else "") + digits, tick_px))
    return PANEL_GAP + COLORBAR_PX + TICK_LEN + 2 + widest + 4 + BOX * label_px + PAD


def for_print(fig: go.Figure, size: str = "double", *, title: bool = True, height: int | None = None) -> go.Figure:
    """``fig`` laid out for a paper column: a new figure, ``paper_width_px(size)`` wide.

    Args:
        fig: a figure of :mod:`attnres_probe.figures` (a heatmap, a row of heatmaps, line charts,
            a grid of panels).
        size: ``"single"`` (3.3 in) or ``"double"`` (7 in).
        title: keep the figure's title (wrapped to the width); ``False`` leaves it to the caption.
        height: the figure's height in px (1/96 in); default: what its panels need (12 px per
            heatmap row, about 0.6 of a line chart's width).

    Returns:
        The figure, with ``layout.width`` and ``layout.height`` set: write it at that size
        (:func:`write_images` does).

    Raises:
        ValueError: an unknown ``size``, or a table (:func:`~attnres_probe.figures.metric_table_figure`).
    """
    width = paper_width_px(size)
    title_px, label_px, tick_px = pt(FONTS.title), pt(FONTS.label), pt(FONTS.tick)
    src = fig.to_plotly_json()
    if any(tr.get("type") == "table" for tr in src.get("data", [])):
        raise ValueError("for_print lays out charts; put a table into the paper as a table "
                         "(e.g. metrics.compare(...).to_latex())")
    data = [copy.deepcopy(tr) for tr in src.get("data", []) if tr.get("visible") != "legendonly"]
    layout = copy.deepcopy(src.get("layout", {}))
    layout.pop("template", None)
    panels = _panels(layout, data)
    _subtitles(layout, panels)
    for p in panels:
        for axis in (p.x, p.y):
            if axis.ax.get("type") == "log":
                axis.kind, axis.length = "log", 150.0  # provisional labels, for the margins; set again below
                _log_ticks(axis, tick_px)
            else:
                _category_labels(axis)
                if axis.labels is None:
                    axis.kind, axis.length = "linear", 150.0
                    _numeric_ticks(axis, tick_px)

    # -- title
    title_text, title_lines = "", 0
    if title:
        raw = layout.get("title")
        raw = raw.get("text") if isinstance(raw, dict) else raw
        parts = (layout.get("meta") or {}).get("title_parts") if isinstance(layout.get("meta"), dict) else None
        if parts:
            raw = " · ".join(str(p) for p in parts)
        if raw:
            title_text, title_lines = wrap(_small_spans(str(raw)), width - 2 * PAD, title_px)
    title_h = _lines_px(title_lines, title_px) + (PAD + 4 if title_lines else 0)

    # -- legend
    items = [tr.get("name") or "" for tr in data if tr.get("type") != "heatmap" and tr.get("showlegend", True) is not False]

    # -- horizontal: margins, gaps, panel widths (twice: horizontal tick labels may overhang)
    heat_traces = [tr for tr in data if tr.get("type") == "heatmap" and tr.get("showscale", True) is not False]
    right0 = _colorbar_px(heat_traces, tick_px, tick_px) if heat_traces else PAD
    rows, cols = _grid(panels, width - 2 * PAD - 40 - right0)
    by_cell = {(p.row, p.col): p for p in panels}
    for p in panels:  # a heatmap's y labels that repeat the left neighbour's: drawn once
        left = by_cell.get((p.row, 0))
        if p.col > 0 and p.heat and left is not None and left.heat and p.y.labels and p.y.labels == left.y.labels:
            p.y.ax.update(showticklabels=False)
            p.y.ax["title"] = {"text": ""}
    overhang = [[0.0, 0.0] for _ in range(cols)]
    for _ in range(2):
        col_w_y = []
        for c in range(cols):
            members = [p for p in panels if p.col == c]
            yw = max((_y_width(p.y, tick_px) for p in members), default=0.0)
            yt = max((_wrap_title(p.y, _rows_px(p), label_px) for p in members), default=0.0)
            col_w_y.append(yw + yt + (TICK_LEN + TICK_GAP if yw else 0.0))
        left_m = PAD + max(col_w_y[0], overhang[0][0])
        gaps = [PANEL_GAP + max(col_w_y[c], overhang[c][0] + overhang[c - 1][1] - PANEL_GAP) for c in range(1, cols)]
        right_m = max(right0, overhang[-1][1] + PAD)
        panel_w = (width - left_m - right_m - sum(gaps)) / cols
        for p in panels:
            p.x.length = panel_w
            _decide_x(p.x, tick_px)
        overhang = [[0.0, 0.0] for _ in range(cols)]
        for p in panels:
            lo, hi = _x_overhang(p.x, tick_px)
            overhang[p.col][0] = max(overhang[p.col][0], lo)
            overhang[p.col][1] = max(overhang[p.col][1], hi)
    legend_h = 0.0
    if items:  # plotly wraps a horizontal legend at the plot area's width
        row_w, legend_rows = 0.0, 1
        for name in items:
            w = LEGEND_SYMBOL_PX + text_width(name, tick_px)
            if row_w and row_w + w > width - left_m - right_m:
                legend_rows, row_w = legend_rows + 1, 0.0
            row_w += w
        legend_h = legend_rows * LEGEND_ROW_PX + 8
    for p in panels:  # each panel's subplot title, wrapped to its width
        if p.subtitle is not None and p.subtitle.get("text"):
            p.subtitle["text"], p.subtitle_lines = wrap(str(p.subtitle["text"]), panel_w, label_px)

    # -- vertical: rows' heights, the room under each (x labels, titles) and above (subplot titles)
    row_h = []
    for r in range(rows):
        members = [p for p in panels if p.row == r]
        heat_rows = [len(p.y.labels) for p in members if p.heat and p.y.labels]
        row_h.append(max(heat_rows) * ROW_PX if heat_rows else min(200.0, max(110.0, 0.62 * panel_w)))

    def above(r: int) -> float:
        n = max((p.subtitle_lines for p in panels if p.row == r), default=0)
        return _lines_px(n, label_px) + 4 if n else 0.0

    def below(r: int) -> float:
        members = [p for p in panels if p.row == r]
        depth = max((_x_depth(p.x, tick_px) for p in members), default=TICK_LEN)
        xt = max((_wrap_title(p.x, panel_w, label_px) for p in members), default=0.0)
        return depth + xt

    top_m = PAD + title_h + above(0) + (2 if not title_h and not above(0) else 0)
    gaps_v = [below(r) + PANEL_GAP + above(r + 1) for r in range(rows - 1)]
    bottom_m = below(rows - 1) + (legend_h + 4 if legend_h else 0.0) + PAD
    fixed = top_m + sum(gaps_v) + bottom_m
    if height is not None:
        scale = max(0.2, (height - fixed) / sum(row_h))
        row_h = [h * scale for h in row_h]
    total_h = int(math.ceil(fixed + sum(row_h)))
    plot_w, plot_h = width - left_m - right_m, total_h - top_m - bottom_m

    # -- domains (paper coordinates) and ticks
    x0 = [0.0] * cols
    pos = 0.0
    for c in range(cols):
        x0[c] = pos
        pos += panel_w + (gaps[c] if c < cols - 1 else 0.0)
    y_top = [0.0] * rows
    pos = 0.0
    for r in range(rows):
        y_top[r] = pos
        pos += row_h[r] + (gaps_v[r] if r < rows - 1 else 0.0)
    for p in panels:
        xd = (x0[p.col] / plot_w, (x0[p.col] + panel_w) / plot_w)
        yd = (1 - (y_top[p.row] + row_h[p.row]) / plot_h, 1 - y_top[p.row] / plot_h)
        xd = (max(0.0, xd[0]), min(1.0, xd[1]))
        yd = (max(0.0, yd[0]), min(1.0, yd[1]))
        p.x.ax["domain"], p.y.ax["domain"] = list(xd), list(yd)
        p.y.length = row_h[p.row]
        if p.subtitle is not None:
            p.subtitle.update(x=sum(xd) / 2, y=yd[1], xanchor="center", yanchor="bottom", yshift=2,
                              font={"size": label_px}, xref="paper", yref="paper")
        for axis in (p.x, p.y):
            if axis.kind == "log":
                _log_ticks(axis, tick_px)
            elif axis.kind == "linear":
                _numeric_ticks(axis, tick_px)
            elif axis.letter == "y" and axis.labels:
                axis.ax["_step"] = _thin(len(axis.labels), axis.length / len(axis.labels), BOX * tick_px + 1)
            _style_axis(axis, tick_px, label_px)

    # -- colour bars: beside their panels (one shared bar: beside every heatmap panel)
    heat_panels = [p for p in panels if p.heat]
    for tr in heat_traces:
        owner = next((p for p in panels if tr in p.x.traces), None)
        spans = heat_panels if len(heat_traces) == 1 and len(heat_panels) > 1 else [owner] if owner else []
        if spans:
            lo = min(p.y.ax["domain"][0] for p in spans)
            hi = max(p.y.ax["domain"][1] for p in spans)
        else:
            lo, hi = 0.0, 1.0
        cb = tr.get("colorbar") or {}
        cb_title = cb.get("title", {}).get("text") if isinstance(cb.get("title"), dict) else cb.get("title")
        tr["colorbar"] = {
            "thickness": COLORBAR_PX, "thicknessmode": "pixels", "len": hi - lo, "lenmode": "fraction",
            "y": (lo + hi) / 2, "yanchor": "middle", "x": 1 + PANEL_GAP / plot_w, "xanchor": "left", "xpad": 0, "ypad": 0,
            "outlinewidth": 0, "ticks": "outside", "ticklen": TICK_LEN, "tickfont": {"size": tick_px},
            "nticks": max(3, min(6, int((hi - lo) * plot_h // (3 * BOX * tick_px)))),
            "title": {"text": cb_title or "", "side": "right", "font": {"size": tick_px}},
        }
    for tr in data:
        if tr.get("type") == "heatmap" and tr.get("texttemplate"):
            tr["textfont"] = {"size": pt(6)}
        if tr.get("type") == "scatter":
            line = dict(tr.get("line") or {})
            line["width"] = min(float(line.get("width", 2)), 1.5)
            tr["line"] = line
            marker = dict(tr.get("marker") or {})
            marker["size"] = min(float(marker.get("size", 6) if not isinstance(marker.get("size"), (list, np.ndarray)) else 6), 4.5)
            tr["marker"] = marker

    # -- notes, shapes, legend, title, page
    for ann in layout.get("annotations") or []:
        if not any(ann is p.subtitle for p in panels):
            font = dict(ann.get("font") or {})
            font["size"] = tick_px
            ann["font"] = font
            if ann.get("text"):
                ann["text"] = _small_spans(str(ann["text"]))
    for shp in layout.get("shapes") or []:
        line = dict(shp.get("line") or {})
        line["width"] = min(float(line.get("width", 1)), 1.0)
        shp["line"] = line
    layout["showlegend"] = bool(items)
    if items:
        layout["legend"] = {"orientation": "h", "x": 0.5, "xanchor": "center", "xref": "container", "y": PAD / total_h,
                            "yanchor": "bottom", "yref": "container", "font": {"size": tick_px}, "title": {"text": ""},
                            "itemwidth": 30, "tracegroupgap": 0, "bgcolor": "rgba(0,0,0,0)", "borderwidth": 0}
    if title_text:
        layout["title"] = {"text": title_text, "x": 0.5, "xanchor": "center", "xref": "container", "y": 1,
                           "yanchor": "top", "yref": "container",
                           # plotly hangs a one-line title 0.2 em higher than asked, and a longer one a further 0.7 em
                           "pad": {"t": PAD + (0.25 + (0.7 if title_lines > 1 else 0.0)) * title_px, "b": 0, "l": 0, "r": 0},
                           "font": {"size": title_px}, "automargin": False}
    else:
        layout["title"] = {"text": ""}
    layout.update(
        width=width, height=total_h, autosize=False, font={"family": FONT_FAMILY, "size": label_px, "color": "#222"},
        margin={"l": left_m, "r": right_m, "t": top_m, "b": bottom_m, "pad": 0, "autoexpand": True},
        plot_bgcolor="white", paper_bgcolor="white", hovermode=False,
    )
    out = go.Figure(data=data, layout=layout)
    out.update_layout(template="plotly_white")
    out.layout.template.layout.plot_bgcolor = "white"
    return out


# -- the standard set ---------------------------------------------------------------------------
def _slug(name: str) -> str:
    """A model name as part of a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def standard_figures(
    traces: Sequence, size: str = "double", *, token: int | None = None, baseline: Any = None, title: bool = True,
    notes: Callable[[str], None] | None = None,
) -> dict[str, go.Figure]:
    """The figures of a paper on these models, laid out for ``size`` (:func:`for_print`), by file stem.

    Double width (``"double"``), the models side by side in each figure: ``routing_mean`` (mean depth
    weights), ``contrib_mean`` (mean contribution shares), ``difference`` (each model's shares minus the
    baseline's), ``magnitudes``, ``gradients``, ``routing_token`` (the depth weights of token ``token``).
    Single width: one figure per model for the heatmaps (``routing_mean_<name>`` ...), the magnitudes and
    gradients of every model in one.

    Args:
        traces: the models' :class:`~attnres_probe.trace.DepthTrace` of one text (gradients recorded
            for ``gradients``).
        size: ``"single"`` or ``"double"``.
        token: the token of ``routing_token`` (negative counts from the last); None: the token whose
            depth weights depart furthest from uniform (``analysis.windows.informative_token``).
        baseline: the trace the differences are taken against (default: the first PreNorm trace;
            none: no ``difference`` figure).
        title: keep each figure's title.
        notes: called with one line for each figure left out and why (default: none said).

    Raises:
        ValueError: no traces, or an unknown size.
        IndexError: a token outside the text.
    """
    from attnres_probe import figures as F

    traces = list(traces)
    if not traces:
        raise ValueError("standard_figures() needs at least one trace")
    paper_width_px(size)
    say_note = notes or (lambda _msg: None)
    for t in traces:
        if token is None:
            token = informative_token(traces)[0]
        t.token_index(token, 0)  # a token outside the text: its own message, before any figure is built
    if baseline is None:
        baseline = next((t for t in traces if t.residual == "prenorm"), None)
    others = [t for t in traces if t is not baseline]
    single = size == "single"
    slugs = _unique([_slug(t.name) for t in traces])
    slug = {id(t): s for t, s in zip(traces, slugs)}
    figs: dict[str, go.Figure] = {}

    def add(name: str, build: Callable[[], go.Figure]) -> None:
        figs[name] = for_print(build(), size, title=title)

    for stem, kind in (("routing_mean", "weights"), ("contrib_mean", "contrib")):
        if single:
            for t in traces:
                add(f"{stem}_{slug[id(t)]}", lambda t=t, kind=kind: F.mean_heatmap(t, kind=kind))
        else:
            add(stem, lambda kind=kind: F.side_by_side(traces, "mean_heatmap", kind=kind))
    if baseline is None:
        say_note("difference: left out (no PreNorm model among them to subtract)")
    elif not others:
        say_note("difference: left out (it needs a model besides the baseline)")
    else:
        comparable = [t for t in others if list(t.read_labels) == list(baseline.read_labels)]
        for t in others:
            if t not in comparable:
                say_note(f"difference: {t.name} left out (its reads differ from {baseline.name}'s; compare models of one depth)")
        if comparable and single:
            for t in comparable:
                add(f"difference_{slug[id(t)]}", lambda t=t: F.difference_heatmap(t, baseline, kind="contrib"))
        elif comparable:
            add("difference", lambda: F.difference_side_by_side(comparable, baseline, kind="contrib"))
    add("magnitudes", lambda: F.magnitudes(traces))
    if any(t.has_gradients for t in traces):
        add("gradients", lambda: F.gradient_norms(traces))
    else:
        say_note("gradients: left out (recorded without a backward pass)")
    if single:
        for t in traces:
            add(f"routing_token_{slug[id(t)]}", lambda t=t: F.token_heatmap(t, token=token, kind="weights"))
    else:
        add("routing_token", lambda: F.side_by_side(traces, "token_heatmap", token=token, kind="weights"))
    return figs


def standard_stems(names: Sequence[str], size: str = "double") -> list[str]:
    """Every file stem :func:`standard_figures` can give models of these names at ``size`` (it leaves out
    those it cannot draw): what a command checks its folder for before recording anything."""
    paper_width_px(size)
    if size == "double":
        return ["routing_mean", "contrib_mean", "difference", "magnitudes", "gradients", "routing_token"]
    slugs = _unique([_slug(n) for n in names])
    return [f"{stem}_{s}" for stem in ("routing_mean", "contrib_mean", "difference") for s in slugs] + [
        "magnitudes", "gradients", *(f"routing_token_{s}" for s in slugs)]


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        k = seen.get(n, 0)
        seen[n] = k + 1
        out.append(n if k == 0 else f"{n}-{k + 1}")
    return out


# -- writing ------------------------------------------------------------------------------------
def _format_of(path: Path, fmt: str | None) -> str:
    fmt = (fmt or path.suffix.lstrip(".")).lower()
    if fmt not in FORMATS:
        raise ValueError(f"format is {fmt!r}; accepted formats are {', '.join(FORMATS)}")
    return fmt


def _png_dpi(png: bytes, dpi: int = DPI) -> bytes:
    """``png`` with a pHYs chunk saying ``dpi`` (after IHDR), so that a document sizes it to print."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or b"pHYs" in png[:256]:
        return png
    ppm = round(dpi / 0.0254)
    body = b"pHYs" + struct.pack(">IIB", ppm, ppm, 1)
    chunk = struct.pack(">I", 9) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)
    end = 8 + 8 + 13 + 4  # signature, IHDR's length and type, its 13 bytes, its CRC
    return png[:end] + chunk + png[end:]


def _svg_inches(svg: bytes, width: int, height: int) -> bytes:
    """The root ``<svg>`` sized in inches (its viewBox unchanged), so a document places it at print size."""
    head, sep, rest = svg.partition(b">")
    head = re.sub(rb'\swidth="[\d.]+"', f' width="{width / CSS_DPI:.4g}in"'.encode(), head, count=1)
    head = re.sub(rb'\sheight="[\d.]+"', f' height="{height / CSS_DPI:.4g}in"'.encode(), head, count=1)
    return head + sep + rest


def _run(coro_fn: Callable[[], Any]) -> Any:
    """Run a coroutine to completion on its own thread (a notebook's event loop may be running here)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=target, name="attnres-kaleido", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def write_images(
    figs: Mapping[str | Path, go.Figure], fmt: str | None = None, *, progress: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write figures as images with one kaleido process (one Chromium) for all of them.

    Each figure is written at its ``layout.width`` x ``layout.height`` (a :func:`for_print` figure's
    print size; else 700 x 500): SVG and PDF exactly that size at 96 px to the inch (the SVG's root
    sized in inches), PNG at :data:`DPI` dots per inch. Each file is written whole or not at all
    (:func:`attnres_probe.io.atomic_write`).

    Starting kaleido (a Chromium) takes seconds, rendering an image well under one, so every image
    goes through one ``kaleido.Kaleido`` opened here (like ``plotly.io.write_images``, which gives no
    word per image; ``kaleido.start_sync_server`` would wait forever where Chromium fails to start).
    Its page loads no MathJax (plotly's asks a CDN for it, which fails offline and now and then fails
    the render with it; no figure here uses LaTeX). It runs on its own thread, so a notebook's event
    loop is no obstacle.

    Args:
        figs: path -> figure; the format is ``fmt`` or each path's suffix.
        fmt: ``"svg"``, ``"png"`` or ``"pdf"`` for every path.
        progress: called with one line per image written ("wrote figs/magnitudes.svg (0.4 s)").

    Returns:
        The paths written, in order.

    Raises:
        ValueError: a format that is not one of :data:`FORMATS`.
        RuntimeError: kaleido found no Chromium or Chrome.
    """
    import time

    from attnres_probe.io import atomic_write

    jobs = []
    for path, fig in figs.items():
        path = Path(path)
        kind = _format_of(path, fmt)
        w = int(fig.layout.width or 700)
        h = int(fig.layout.height or 500)
        jobs.append((path, kind, fig.to_dict(), w, h))
    if not jobs:
        return []

    async def render() -> list[Path]:
        import kaleido
        from kaleido.errors import ChromeNotFoundError

        try:
            k = kaleido.Kaleido(n=1, mathjax=False)
        except ChromeNotFoundError as exc:
            raise RuntimeError(f"writing images needs Chromium or Chrome (kaleido drives it): {exc}") from None
        written = []
        async with k:
            for path, kind, spec, w, h in jobs:
                t0 = time.perf_counter()
                data = await k.calc_fig(spec, opts={"format": kind, "width": w, "height": h,
                                                    "scale": DPI / CSS_DPI if kind == "png" else 1})
                if kind == "png":
                    data = _png_dpi(data)
                elif kind == "svg":
                    data = _svg_inches(data, w, h)
                atomic_write(path, lambda p, data=data: p.write_bytes(data))
                written.append(path)
                if progress is not None:
                    progress(f"wrote {path} ({time.perf_counter() - t0:.1f} s)")
        return written

    return _run(render)
