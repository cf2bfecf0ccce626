"""Every chart of attnres-probe, built once here (plotly ``graph_objects``).

The notebook API (``DepthTrace.heatmap`` etc., bound onto DepthTrace at the end of this
module), the Dash dashboard and the HTML reports all call these functions; nobody draws the same
chart twice.

Conventions shared by every chart:

- Heatmaps put reads on y (first read at the top) and sources on x, on the trace's common
  source axis (``trace.source_labels``) or, with ``expanded=True``, the L+1 sublayer axis.
  Unavailable cells are NaN and stay blank (never drawn as zero) and have no hover.
- Depth weights (0..1) use one sequential scale fixed to 0..1 (:data:`WEIGHT_COLORSCALE`).
  Signed quantities use a diverging scale centred on 0 (:data:`DIVERGING_COLORSCALE`):
  contribution shares (they can be negative or above one; range at least -1..1), logits and
  differences between models (:func:`difference_heatmap`).
- Token axes stay legible at any length: at most one tick per ~20 px (:func:`token_ticks`); the
  hover names every token. Titles are wrapped onto lines, never cut.
- PreNorm has no routing: its weights (all one) and logits panels are blank with one note that
  names the UI control to use ("colour by: contribution share").
- Each model name gets one colour (:func:`model_colors`), the same in every line chart.
- Text from a trace (token strings, names, flags) goes into plotly as data, which plotly
  renders safely; the one function here that writes HTML, :func:`trace_summary_html`, escapes
  every such string with :func:`html.escape`.
"""

from __future__ import annotations

import functools
import html
import json
import math
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnres_probe import metrics
from attnres_probe.axis import COEFFICIENT_RULES
from attnres_probe.numeric import over_sum, row_sum, token_mean
from attnres_probe.trace import DepthTrace, unique_names

__all__ = [
    "BASELINE_COLOR",
    "LOGIT_COLORSCALE",
    "MODEL_PALETTE",
    "WEIGHT_COLORSCALE",
    "ablation_chart",
    "corpus_heatmap",
    "corpus_side_by_side",
    "difference_heatmap",
    "difference_side_by_side",
    "gradient_bands",
    "gradient_norms",
    "log_axis",
    "logit_contributions_chart",
    "logit_lens_chart",
    "attention_pattern_chart",
    "token_pattern",
    "magnitude_bands",
    "magnitudes",
    "mean_heatmap",
    "metric_table_figure",
    "model_colors",
    "side_by_side",
    "source_heatmap",
    "token_heatmap",
    "token_ticks",
    "trace_summary_html",
    "weight_effect_chart",
]

# -- the project's colours, defined once ------------------------------------------------------
WEIGHT_COLORSCALE = "Viridis"  # depth weights, zmin=0, zmax=1
DIVERGING_COLORSCALE = "RdBu_r"  # signed values (contribution shares, logits, differences), centred on 0
LOGIT_COLORSCALE = DIVERGING_COLORSCALE
COLORSCALES = {"weights": WEIGHT_COLORSCALE, "contrib": DIVERGING_COLORSCALE, "logits": DIVERGING_COLORSCALE}
# the UI control a blank PreNorm panel points to (dashboard radio and report select say the same words)
CONTRIB_CONTROL = "colour by: contribution share"
PRENORM_NOTES = {  # PreNorm's weights are drawn: its implied weights 1/k (see implied_weights)
    "logits": "PreNorm has no depth logits<br>(every source has weight 1).<br>"
              f"Choose “{CONTRIB_CONTROL}”<br>to compare it with AttnRes.",
}
KIND_TITLES = {"weights": "depth weight α", "logits": "depth logit z", "contrib": "contribution share c"}
IMPLIED_TITLE = "implied weight 1/k"  # PreNorm's weights: every source added with weight 1, normalised
NORMALISED_TITLE = "normalised weight c/Σc"  # Hyper-Connections', DenseFormer's weights (docs/depth_rules.md)
RULE_NOTES = {  # rules without depth logits: what a blank logits panel says
    "logits": "This rule has no depth logits<br>(its reads are linear combinations<br>with learned coefficients).<br>"
              f"Choose “{CONTRIB_CONTROL}”<br>or the depth weights.",
}
BASELINE_COLOR = "#7F7F7F"  # PreNorm
# fixed colours for the demo models' names; other names take MODEL_PALETTE in order
FIXED_COLORS = {"prenorm": BASELINE_COLOR, "full": "#1F77B4", "block": "#FF7F0E", "mhc": "#2CA02C", "denseformer": "#9467BD"}
# models in order: hues far apart first (red and brown, once neighbours, were hard to tell apart)
MODEL_PALETTE = ("#D62728", "#1F77B4", "#2CA02C", "#9467BD", "#FF7F0E", "#17BECF", "#E377C2", "#8C564B", "#BCBD22")
BOUNDARY_LINE = {"color": "black", "width": 2}
HOVER_CELLS = (
    "read %{y}<br>source %{x}<br>weight %{customdata[0]:.6~g}<br>logit %{customdata[1]:.6~g}"
    "<br>contribution %{customdata[2]:.6~g}<extra></extra>"
)
HEATMAPS = ("token_heatmap", "mean_heatmap", "source_heatmap")
_KINDS = ("weights", "logits", "contrib")


def model_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per model name, deterministic: the demo models' names have fixed colours;
    every other name takes the next unused colour of :data:`MODEL_PALETTE` in order of first appearance."""
    out: dict[str, str] = {}
    used = {FIXED_COLORS[n] for n in names if n in FIXED_COLORS}
    free = iter([c for c in MODEL_PALETTE if c not in used] or MODEL_PALETTE)
    for n in names:
        if n in out:
            continue
        if n in FIXED_COLORS:
            out[n] = FIXED_COLORS[n]
        else:
            out[n] = next(free, None) or MODEL_PALETTE[len(out) % len(MODEL_PALETTE)]
    return out


# -- shared helpers ---------------------------------------------------------------------------
def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"kind is {kind!r}; accepted values are {', '.join(_KINDS)}")


def cell_values(trace: DepthTrace, expanded: bool, index: tuple | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
    """{kind: [B, P, R, S'] float64 with -inf -> NaN}, column labels; ``index`` (e.g. (batch, pos))
    selects before converting, so one token's cells do not cost a copy of the whole cube."""
    out, labels = {}, trace.source_labels
    for k in _KINDS:
        if expanded:
            arr, labels = trace.expanded(k)
        else:
            arr = trace.cube(k)
        if index is not None:
            arr = arr[index]
        arr = np.asarray(arr, dtype=np.float64)
        out[k] = np.where(np.isinf(arr), np.nan, arr)  # -inf logit padding = unavailable
    if trace.residual in COEFFICIENT_RULES:  # coefficients (PreNorm's ones, HC's, DenseFormer's) over their sum
        out["weights"] = implied_weights(out["weights"])
    return out, list(labels)


def quote_token(tok: str) -> str:
    """A token label in quotes for a title or an axis: the label as it is (a newline's label is
    already the two characters ``\\n``), not its Python repr, which doubles the backslash."""
    return f"'{tok}'"


def implied_weights(coefficients: np.ndarray) -> np.ndarray:
    """A read's coefficients over their sum: PreNorm's implied weights (its coefficients are all
    one), 1/k for the k sources a read sees (NaN where it sees none); Hyper-Connections' and
    DenseFormer's normalised coefficients (entries may be negative or above one). Every consumer
    of a read is an RMSNorm, so the read and this normalised mixture are the same input: these are
    the weights AttnRes is compared with. A read whose coefficients cancel has none (NaN:
    :func:`attnres_probe.numeric.over_sum`)."""
    return over_sum(coefficients)


def kind_title(trace, kind: str) -> str:
    """The coloured value's name for ``trace``: PreNorm's weights are its implied weights, 1/k;
    Hyper-Connections' and DenseFormer's their normalised coefficients."""
    residual = getattr(trace, "residual", None) or (getattr(trace, "meta", None) or {}).get("residual")  # traces, stats
    if kind == "weights" and residual == "prenorm":
        return IMPLIED_TITLE
    if kind == "weights" and residual in COEFFICIENT_RULES:
        return NORMALISED_TITLE
    return KIND_TITLES[kind]


def show_token(tok: str) -> str:
    """A token made visible for tick labels: newline -> ↵, tab -> ⇥, space -> ␣ (plain text, not HTML)."""
    shown = tok.replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")
    return shown if shown else "∅"


def _color_range(kind: str, z: np.ndarray) -> dict:
    """Weights 0..1, widened to take normalised coefficients below 0 or above 1 (Hyper-Connections,
    DenseFormer); logits and differences symmetric around 0 (the widest |z|); contribution shares
    symmetric around 0 and at least -1..1 (a share of 1 is full colour, negatives show blue)."""
    if kind in ("logits", "contrib", "diff"):
        finite = np.abs(z[np.isfinite(z)])
        m = float(finite.max()) if finite.size else 1.0
        if kind == "contrib":
            m = max(m, 1.0)
        return {"zmin": -max(m, 1e-6), "zmax": max(m, 1e-6), "zmid": 0.0}
    finite = z[np.isfinite(z)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    return {"zmin": min(0.0, lo), "zmax": max(1.0, hi)}


TICK_PX = 14  # one token tick per this many pixels (plus the label's width)


def source_tickangle(n_labels: int) -> int:
    """The source axis's label angle: flat for up to 8 sources, upright past that (a panel a third of a
    page wide gives each of 17 sources about 15 px, less than a slanted label's box needs)."""
    return 0 if n_labels <= 8 else -90


def token_ticks(tokens: Sequence[str], plot_px: int = 300, start: int = 0,
                positions: bool = False) -> tuple[list[int], list[str]]:
    """Tick positions and labels for a token axis that stay legible at any length.

    At most one tick per ``TICK_PX`` pixels plus the widest label (labels cut to 6 characters) on
    a plot ``plot_px`` wide; every ``step``-th token, ``step`` a 1-2-5 number. The hover still names
    every token. ``positions``: each label is two lines, the token's position over its text.
    """
    shown = [show_token(t) for t in tokens]
    shown = [t if len(t) <= 6 else t[:5] + "…" for t in shown]
    n = len(shown)
    if n == 0:
        return [], []
    width = TICK_PX + 7 * max(max(len(t) for t in shown), len(str(n + start)) if positions else 0)
    room = max(1, plot_px // width)
    step = 1
    for cand in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000):
        step = cand
        if math.ceil(n / cand) <= room:
            break
    vals = list(range(0, n, step))
    text = [f"{v + start}<br>{shown[v]}" if positions else shown[v] for v in vals]
    return [v + start for v in vals], text


def _title(parts: Sequence[str]) -> str:
    """A title on one line per part, so a narrow panel never cuts it."""
    return "<br>".join(parts)


TITLE_LINE_PX = 22  # one title line at plotly's default 17 px title font (line spacing 1.3)
TITLE_ASCENT_PX = 16  # from the top of the first line to its baseline
TITLE_PAD_PX = 8  # above the title's first line


def _title_layout(parts: Sequence[str]) -> dict:
    """The title of a figure whose title has one line per part, hung from the top of the figure into a top
    margin (:func:`_title_margin`) tall enough for every line, so the last line never sits on the plot.

    Plotly's default puts the first line's baseline at the middle of the top margin, and its anchors
    place only the first line (the lines after it run down from there), which pushed a third line onto
    the first heatmap row. Here the first baseline sits ``TITLE_PAD_PX + TITLE_ASCENT_PX`` below the
    top of the figure and the others follow, well above the plot."""
    return {"text": _title(parts), "y": 1, "yref": "container", "yanchor": "top",
            "pad": {"t": TITLE_PAD_PX + TITLE_ASCENT_PX}}


def _title_margin(parts: Sequence[str]) -> dict:
    """The top margin that holds a :func:`_title_layout` title of ``parts`` with a gap above the plot."""
    return {"t": TITLE_PAD_PX + TITLE_LINE_PX * len(parts) + 20}


COMPACT_ROW_PX = 14  # one read's row in a compact heatmap (a page's first screen)


def compact(fig: go.Figure, drop_first: bool = True) -> go.Figure:
    """A reads x sources heatmap made to fit a page's first screen: its title on one line (without
    the model's name, which the page's panel already shows, when ``drop_first``) and rows of
    :data:`COMPACT_ROW_PX`. The title's parts stay in ``layout.meta["title_parts"]``."""
    parts = list((fig.layout.meta or {}).get("title_parts") or [fig.layout.title.text or ""])
    shown = parts[1:] if drop_first and len(parts) > 1 else parts
    line = [" · ".join(shown)]
    n_rows = len(fig.data[0].y) if fig.data and fig.data[0].y is not None else 0
    fig.update_layout(title=_title_layout(line), margin=_title_margin(line),
                      height=max(280, COMPACT_ROW_PX * n_rows + 110 + TITLE_LINE_PX))
    return fig


def _read_block_lines(trace: DepthTrace) -> list[dict]:
    """Horizontal lines between reads of different blocks (block traces only), final read set apart."""
    if trace.residual != "block":
        return []
    L = len(trace.sublayer_labels)
    cuts = sorted({s for s in trace.block_starts if 0 < s < L} | {L})
    return [
        dict(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=s - 0.5, y1=s - 0.5, line=BOUNDARY_LINE)
        for s in cuts
    ]


def _source_block_lines(trace: DepthTrace) -> list[dict]:
    """Vertical lines at block starts on the expanded (embed + sublayer) axis."""
    if trace.residual != "block":
        return []
    return [
        dict(type="line", yref="y domain", y0=0, y1=1, xref="x", x0=s + 0.5, x1=s + 0.5, line=BOUNDARY_LINE)
        for s in trace.block_starts
    ]


def _note(text: str, xref: str = "x domain", yref: str = "y domain", y: float = 0.5) -> dict:
    return dict(text=text, xref=xref, yref=yref, x=0.5, y=y, showarrow=False, font={"size": 13, "color": "#555"})


# Figures here are built in one step, ``go.Figure(data=..., layout=...)``: plotly validates a layout
# given to the constructor once, while every ``update_layout`` / ``update_yaxes`` call validates and
# copies again, and ``make_subplots`` + ``add_trace(row=, col=)`` costs about 25 ms a figure; one
# step is 4-7 times faster, which is most of a dashboard callback (benchmarks/dashboard.py).
@functools.lru_cache(maxsize=64)
def _grid_json(rows: int, cols: int, titled: bool, options: tuple) -> str:
    titles = [f"\x00{i}" for i in range(rows * cols)] if titled else None
    layout = make_subplots(rows=rows, cols=cols, subplot_titles=titles, **dict(options)).layout.to_plotly_json()
    layout.pop("template", None)
    return json.dumps(layout)


def grid_layout(rows: int, cols: int, subplot_titles: Sequence[str] | None = None, **options) -> dict:
    """The layout :func:`plotly.subplots.make_subplots` makes for this grid (axes' domains and anchors,
    subplot titles as annotations), computed once per grid shape and returned as a fresh dict; put a
    trace in cell (row, col) with :func:`cell_axes`. ``options`` go to make_subplots (lists as tuples)."""
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))
    layout = json.loads(_grid_json(rows, cols, subplot_titles is not None, key))
    if subplot_titles is not None:
        titles = list(subplot_titles) + [""] * (rows * cols - len(subplot_titles))
        for ann in layout.get("annotations", []):
            ann["text"] = titles[int(ann["text"][1:])]
    return layout


def cell_axes(row: int, col: int, cols: int) -> dict[str, str]:
    """``{"xaxis": "x3", "yaxis": "y3"}``: the axes of cell (row, col) of a :func:`grid_layout` grid
    (make_subplots numbers them row by row from the top left)."""
    k = (row - 1) * cols + col
    sfx = "" if k == 1 else str(k)
    return {"xaxis": f"x{sfx}", "yaxis": f"y{sfx}"}


def _axis_key(axis: str) -> str:
    """"x2" -> "xaxis2" (the layout key of a trace's axis reference)."""
    return f"{axis[0]}axis{axis[1:]}"


def _empty_note(trace: DepthTrace, kind: str, z: np.ndarray) -> list[dict]:
    if np.isfinite(z).any():
        return []
    notes = PRENORM_NOTES if trace.residual == "prenorm" else RULE_NOTES if trace.residual in COEFFICIENT_RULES else {}
    if kind in notes:
        note = _note(notes[kind])
        note.update(bgcolor="rgba(255,255,255,0.9)", align="center")
        return [note]
    return [_note(f"no {kind} recorded")]


def _cell_heatmap(
    trace: DepthTrace, cells: dict[str, np.ndarray], labels: list[str], kind: str, parts: list[str], expanded: bool
) -> go.Figure:
    """Reads x sources heatmap of ``cells[kind]`` ([R, S']), hover = weight, logit, contrib;
    ``parts`` = the title's lines (name, what, kind)."""
    z = cells[kind]
    custom = np.stack([cells[k] for k in _KINDS], axis=-1)  # (R, S', 3)
    heat = go.Heatmap(
        z=z,
        x=labels,
        y=trace.read_labels,
        customdata=custom,
        hovertemplate=HOVER_CELLS,
        hoverongaps=False,
        colorscale=COLORSCALES[kind],
        colorbar={"title": {"text": kind}},
        **_color_range(kind, z),
    )
    shapes = _read_block_lines(trace) + (_source_block_lines(trace) if expanded else [])
    notes = _empty_note(trace, kind, z)
    return go.Figure(data=[heat], layout=dict(
        title=_title_layout(parts),
        meta={"title_parts": list(parts)},
        margin=_title_margin(parts),
        shapes=shapes,
        annotations=notes,
        plot_bgcolor="white",
        height=max(320, 24 * len(trace.read_labels) + 120 + 20 * len(parts)),
        xaxis={"title": {"text": "source"}, "showgrid": False, "tickangle": source_tickangle(len(labels))},
        yaxis={"title": {"text": "read"}, "autorange": "reversed", "showgrid": False},
    ))


# -- heatmaps ---------------------------------------------------------------------------------
def token_heatmap(
    trace: DepthTrace, token: int = 0, batch: int = 0, kind: str = "weights", expanded: bool = False
) -> go.Figure:
    """Depth routing of one token: reads (y, first at top) x sources (x).

    Args:
        trace: the record.
        token: position in sequence ``batch`` (negative counts from the last real token).
        batch: which sequence.
        kind: the coloured value, ``"weights"`` | ``"logits"`` | ``"contrib"``; hover always shows
            all three for the cell.
        expanded: block traces on the L+1 sublayer axis (``trace.expanded``), with vertical lines
            at block starts.

    Returns:
        Figure with one Heatmap: ``z`` [R, S] (or [R, L+1] expanded), NaN where unavailable;
        ``customdata`` [R, S, 3] = (weight, logit, contrib). Block traces get horizontal lines
        between reads of different blocks.
    """
    _check_kind(kind)
    if not 0 <= batch < trace.tokens.shape[0]:
        raise IndexError(f"batch {batch} is out of range; this trace has {trace.tokens.shape[0]} sequences (0..{trace.tokens.shape[0] - 1})")
    pos = trace.token_index(token, batch)
    cells, labels = cell_values(trace, expanded, index=(batch, pos))
    tok = trace.str_tokens[batch][pos] if pos < len(trace.str_tokens[batch]) else ""
    parts = [trace.name, f"token {pos} {quote_token(tok)} (sequence {batch})", kind_title(trace, kind)]
    return _cell_heatmap(trace, cells, labels, kind, parts, expanded)


def mean_heatmap(trace: DepthTrace, kind: str = "weights", expanded: bool = False) -> go.Figure:
    """Depth routing averaged over every real token: reads (y) x sources (x).

    Same layout, hover and block marks as :func:`token_heatmap`; each cell is the NaN-aware mean
    over real tokens (a cell unavailable to every token stays NaN).

    Returns:
        Figure with one Heatmap, ``z`` [R, S] (or [R, L+1] expanded), ``customdata`` [R, S, 3].
    """
    _check_kind(kind)
    cells, labels = cell_values(trace, expanded)
    cells = {k: token_mean(v[trace.mask]) for k, v in cells.items()}
    parts = [trace.name, f"mean over {trace.n_tokens} tokens", kind_title(trace, kind)]
    return _cell_heatmap(trace, cells, labels, kind, parts, expanded)


COMPACT_TOKENS = 256  # above this many tokens a one-source heatmap sends only its coloured values


def source_heatmap(
    trace: DepthTrace, source: int | str = 0, batch: int = 0, kind: str = "weights", plot_px: int = 300,
    compact: bool | None = None,
) -> go.Figure:
    """One source's routing value at every token: tokens (x) x reads (y).

    Source 0 shows embedding retention token by token. Tokens sit at positions 0..n−1 on x,
    labelled with their strings (duplicates allowed), thinned by :func:`token_ticks` so labels
    never overlap on a plot ``plot_px`` wide (the hover names every token).

    Returns:
        Figure with one Heatmap: ``z`` [R, n_tokens] (NaN where the source is unavailable),
        ``customdata`` [R, n_tokens, 3] = (weight, logit, contrib), ``text`` = token strings.
        ``compact`` (default: above :data:`COMPACT_TOKENS` tokens) keeps only ``z``, as float32,
        so a long trace's page stays light: the tokens then go once per column, as the x axis's
        categories ("12 'a'": position and token, which the hover shows), not once per cell.
    """
    _check_kind(kind)
    if not 0 <= batch < trace.tokens.shape[0]:
        raise IndexError(f"batch {batch} is out of range; this trace has {trace.tokens.shape[0]} sequences (0..{trace.tokens.shape[0] - 1})")
    s = trace.source_index(source)
    n = int(trace.mask[batch].sum())
    cells, _ = cell_values(trace, expanded=False)
    cells = {k: v[batch, :n, :, s].T for k, v in cells.items()}  # (R, n)
    z = cells[kind]
    toks = list(trace.str_tokens[batch][:n]) + [""] * max(0, n - len(trace.str_tokens[batch]))
    compact = n > COMPACT_TOKENS if compact is None else compact
    categories = None
    if compact:
        # a long trace: only the coloured value, as float32 (sent base64-packed); no per-cell
        # token text or (weight, logit, share) triple, which would be 4-6 times the data. The
        # token text goes once per column, as the category of x ("12 'a'"), which the hover names.
        categories = [f"{i} {quote_token(t)}" for i, t in enumerate(toks)]
        heat = go.Heatmap(
            z=z.astype(np.float32), x=categories, y=trace.read_labels,
            hovertemplate=f"token %{{x}}<br>read %{{y}}<br>{kind_title(trace, kind)} %{{z:.4~g}}<extra></extra>",
        )
    else:
        text = np.tile(np.asarray([repr(t) for t in toks], dtype=object), (z.shape[0], 1))
        heat = go.Heatmap(
            z=z, x=np.arange(n), y=trace.read_labels, customdata=np.stack([cells[k] for k in _KINDS], axis=-1), text=text,
            hovertemplate="token %{x} %{text}<br>" + HOVER_CELLS.replace("source %{x}<br>", ""),
        )
    heat.update(hoverongaps=False, colorscale=COLORSCALES[kind], colorbar={"title": {"text": kind}}, **_color_range(kind, z))
    label = trace.source_labels[s]
    parts = [trace.name, f"source {label} at every token (sequence {batch})", kind_title(trace, kind)]
    tickvals, ticktext = token_ticks(toks, plot_px, positions=True)
    if categories is not None:
        tickvals = [categories[v] for v in tickvals]
    return go.Figure(data=[heat], layout=dict(
        title=_title_layout(parts),
        meta={"title_parts": parts, "tokens": [str(t) for t in toks]},
        margin=_title_margin(parts),
        shapes=_read_block_lines(trace),
        annotations=_empty_note(trace, kind, z),
        plot_bgcolor="white",
        height=max(320, 24 * len(trace.read_labels) + 140 + 20 * len(parts)),
        xaxis={
            "title": {"text": "token"},
            "tickmode": "array",
            "tickvals": tickvals,
            "ticktext": ticktext,
            "tickangle": 0,
            "range": [-0.5, n - 0.5],  # the whole text, even on a blank (PreNorm weights) panel
            "showgrid": False,
            **({"type": "category"} if categories is not None else {}),
        },
        yaxis={"title": {"text": "read"}, "autorange": "reversed", "showgrid": False},
    ))


def _remap_ref(ref: str | None, sfx: str) -> str | None:
    if not ref or ref == "paper":
        return ref
    axis, _, rest = ref.partition(" ")
    return f"{axis[0]}{sfx}{' ' + rest if rest else ''}"


def side_by_side(
    traces: Sequence[DepthTrace],
    fn_name: str | Callable[..., go.Figure] = "mean_heatmap",
    names: Sequence[str] | None = None,
    **kw,
) -> go.Figure:
    """One heatmap per trace, in a row of subplots (AttnRes models beside the PreNorm baseline).

    Args:
        traces: the traces, left to right.
        fn_name: ``"token_heatmap"`` | ``"mean_heatmap"`` | ``"source_heatmap"`` (or such a function).
        names: subplot titles (default: each figure's own title).
        **kw: passed to the heatmap function for every trace (``kind``, ``token``, ``expanded``, ...).

    Returns:
        Figure with one Heatmap per trace (in order) sharing one colour range (logits: the widest
        symmetric range of all); block lines and notes kept on their own subplot.
    """
    if not traces:
        raise ValueError("side_by_side() needs at least one trace")
    if isinstance(fn_name, str):
        if fn_name not in HEATMAPS:
            raise ValueError(f"fn_name is {fn_name!r}; accepted values are {', '.join(HEATMAPS)}")
        fn = globals()[fn_name]
    else:
        fn = fn_name
    figs = [fn(t, **kw) for t in traces]
    kind = kw.get("kind", "weights")
    # each panel's title: its own lines without the kind (the kind goes once into the figure's title)
    part_lists = []
    for i, (f, t) in enumerate(zip(figs, traces)):
        parts = list((f.layout.meta or {}).get("title_parts") or [f.layout.title.text or t.name])
        if parts and parts[-1] == KIND_TITLES.get(kind):
            parts = parts[:-1]
        if names is not None:
            parts = [str(names[i]), *parts[1:]] if len(parts) > 1 else [str(names[i])]
        part_lists.append(parts)
    titles = [_title(p) for p in part_lists]
    lines = max(len(p) for p in part_lists)
    n = len(figs)
    out = make_subplots(rows=1, cols=n, subplot_titles=titles, horizontal_spacing=min(0.08, 0.4 / max(n - 1, 1)))
    for ann in out.layout.annotations:
        ann.font = {"size": 13}
    zmax = max(float(f.data[0].zmax) for f in figs) if kind in ("logits", "contrib") else 1.0
    shapes, notes = [], list(out.layout.annotations)
    for i, f in enumerate(figs):
        sfx = "" if i == 0 else str(i + 1)
        for tr in f.data:
            tr = go.Heatmap(tr)
            tr.showscale = i == n - 1
            if kind in ("logits", "contrib") and tr.zmin is not None and tr.zmin < 0:
                tr.zmin, tr.zmax = -zmax, zmax
            out.add_trace(tr, row=1, col=i + 1)
        for shp in f.layout.shapes:
            d = shp.to_plotly_json()
            d["xref"], d["yref"] = _remap_ref(d.get("xref"), sfx), _remap_ref(d.get("yref"), sfx)
            shapes.append(d)
        for ann in f.layout.annotations:
            d = ann.to_plotly_json()
            d["xref"], d["yref"] = _remap_ref(d.get("xref"), sfx), _remap_ref(d.get("yref"), sfx)
            notes.append(d)
        xa = f.layout.xaxis
        toks = (f.layout.meta or {}).get("tokens")
        if toks is not None:  # a token axis: thin its ticks for a panel 1/n as wide
            vals, text = token_ticks(toks, max(120, 900 // n))
            if xa.type == "category":  # a compact source heatmap: ticks at its categories
                vals = [f.data[0].x[v] for v in vals]
            out.update_xaxes(row=1, col=i + 1, tickmode="array", tickvals=vals, ticktext=text, tickangle=0, showgrid=False,
                             range=xa.range, **({"type": "category"} if xa.type == "category" else {}))
        else:
            # flat labels fit 24 to a page (8 in a third of it): a panel 1/n as wide takes 24/n of them flat
            n_labels = len(xa.ticktext or xa.tickvals or (f.data[0].x if f.data and f.data[0].x is not None else ()))
            angle = -90 if xa.tickangle == 0 and n_labels * n > 24 else xa.tickangle
            out.update_xaxes(row=1, col=i + 1, tickmode=xa.tickmode, tickvals=xa.tickvals, ticktext=xa.ticktext, tickangle=angle, showgrid=False)
    out.update_yaxes(autorange="reversed", showgrid=False)
    out.update_layout(
        shapes=shapes,
        annotations=notes,
        plot_bgcolor="white",
        height=max(f.layout.height or 400 for f in figs) + 20,
        margin={"t": 60 + 18 * lines},
        title={"text": shared_title(traces, kind), "y": 0.99, "yanchor": "top"},
    )
    return out


def shared_title(traces: Sequence[DepthTrace], kind: str) -> str:
    """The title over panels of ``kind``: the quantity's name when every panel shows the same one,
    else each rule's ("depth weights: implied weight 1/k; depth weight α; normalised coefficient
    c/Σc"), whose panels name theirs again."""
    titles = list(dict.fromkeys(kind_title(t, kind) for t in traces))
    if len(titles) <= 1 or kind != "weights":
        return titles[0] if titles else KIND_TITLES.get(kind, kind)
    return "depth weights: " + "; ".join(titles)


def difference_heatmap(
    trace: DepthTrace, baseline: DepthTrace, kind: str = "contrib", token: int | None = None, batch: int = 0
) -> go.Figure:
    """An AttnRes model minus the baseline, cell by cell: reads (y) x sources (x), like from like.

    Both traces are put on one source axis: a Block trace's own (block units), with the other
    model's shares (or normalised weights) summed into the same blocks, so a row of share
    differences sums to about 0; Full and PreNorm on sublayers. Logits do not add up over a block:
    they compare on the sublayer axis (:meth:`DepthTrace.expanded`). They need the same reads
    (same depth); two Block traces need the same blocks. ``token=None`` compares the means over
    real tokens; a token compares that token (the traces should hold the same text). The scale
    diverges around 0 (red: the model puts more there than the baseline, blue: less). Against a
    PreNorm baseline only contribution shares compare: its normalised weights are uniform by
    construction (the routing pages set AttnRes against them).

    Returns:
        Figure with one Heatmap: ``z`` [R, S] = model − baseline on the common axis (NaN where
        either is unavailable), ``customdata`` [R, S, 2] = (model, baseline).

    Raises:
        ValueError: reads that differ, two Block layouts, or weights / logits against a PreNorm baseline.
    """
    _check_kind(kind)
    if kind != "contrib" and "prenorm" in (trace.residual, baseline.residual):
        raise ValueError(
            f"PreNorm has no routing {'weights' if kind == 'weights' else 'logits'} (its coefficients are all one): "
            f"subtract contribution shares instead (kind='contrib')"
        )
    if list(trace.read_labels) != list(baseline.read_labels):
        raise ValueError(
            f"cannot subtract {baseline.name!r} from {trace.name!r}: their reads differ "
            f"({len(trace.read_labels)} vs {len(baseline.read_labels)}); compare models of the same depth"
        )
    blocks = [t for t in (trace, baseline) if t.residual == "block"]
    if len(blocks) == 2 and list(trace.block_starts) != list(baseline.block_starts):
        raise ValueError(
            f"cannot subtract {baseline.name!r} from {trace.name!r}: their blocks differ "
            f"(starts {baseline.block_starts} vs {trace.block_starts}); compare Block models of one layout"
        )
    axis = blocks[0] if blocks and kind != "logits" else None  # the coarser axis both are put on
    vals = []
    for t in (trace, baseline):
        index = None if token is None else (batch, t.token_index(token, batch))
        vals.append(_difference_cells(t, kind, index, axis))
    labels = axis.source_labels if axis is not None else ["embed", *trace.sublayer_labels]
    z = vals[0] - vals[1]
    if token is None:
        what = "mean over tokens"
    else:  # as token_heatmap's title: position, the token's text, sequence
        pos = trace.token_index(token, batch)
        tok = trace.str_tokens[batch][pos] if pos < len(trace.str_tokens[batch]) else ""
        what = f"token {pos} {quote_token(tok)} (sequence {batch})"
    parts = [f"{trace.name} − {baseline.name}", what, f"difference in {KIND_TITLES[kind]}"]
    heat = go.Heatmap(
        z=z, x=labels, y=trace.read_labels, customdata=np.stack(vals, axis=-1), hoverongaps=False,
        hovertemplate=f"read %{{y}}<br>source %{{x}}<br>{html.escape(trace.name)} %{{customdata[0]:.4~g}}"
        f"<br>{html.escape(baseline.name)} %{{customdata[1]:.4~g}}<br>difference %{{z:.4~g}}<extra></extra>",
        colorscale=DIVERGING_COLORSCALE, colorbar={"title": {"text": "difference"}}, **_color_range("diff", z),
    )
    return go.Figure(data=[heat], layout=dict(
        title=_title_layout(parts), meta={"title_parts": parts}, margin=_title_margin(parts),
        # on Block's own axis each column is a block: no sublayer boundaries to draw across the sources
        shapes=_read_block_lines(trace) + (_source_block_lines(trace) if axis is None else []), plot_bgcolor="white",
        annotations=[] if np.isfinite(z).any() else [_note("no cell is available to both models")],
        height=max(320, 24 * len(trace.read_labels) + 120 + 20 * len(parts)),
        xaxis={"title": {"text": "source (block)" if axis is not None else "source (sublayer)"}, "showgrid": False,
               "tickangle": source_tickangle(len(labels))},
        yaxis={"title": {"text": "read"}, "autorange": "reversed", "showgrid": False},
    ))


def _difference_cells(t: DepthTrace, kind: str, index: tuple | None, axis: DepthTrace | None) -> np.ndarray:
    """[R, S] one trace's cells for :func:`difference_heatmap`: the mean over real tokens (``index`` None)
    or one token; shares or normalised weights on ``axis``'s block columns (summed over each block's
    members when ``t`` has sublayer sources), else on the sublayer axis."""
    from attnres_probe.analysis.windows import normalised_weights

    if axis is None:  # the sublayer axis
        cells, _ = cell_values(t, expanded=True, index=index)
        arr = cells[kind]
        return token_mean(arr[t.mask]) if index is None else arr
    arr = np.asarray(t.contrib if kind == "contrib" else normalised_weights(t, t.depth_weights), np.float64)
    arr = token_mean(arr[t.mask]) if index is None else arr[index]  # [R, S_t]
    if t.residual == "block":
        return arr
    column = {label: i for i, label in enumerate(t.source_labels)}
    out = np.full((len(axis.read_labels), len(axis.source_labels)), np.nan)
    for r in range(len(axis.read_labels)):  # each block column: the sum of its members' cells (shares add up)
        for j, members in enumerate(axis.axis.members(r)):
            out[r, j] = sum(arr[r, column[m]] for m in members)
    return out


def difference_side_by_side(
    traces: Sequence[DepthTrace], baseline: DepthTrace, kind: str = "contrib", names: Sequence[str] | None = None
) -> go.Figure:
    """:func:`difference_heatmap` of every trace against ``baseline`` (means over tokens), in a row on
    one colour range symmetric around zero.

    Args:
        traces: the AttnRes traces, of the baseline's depth (the same reads).
        baseline: what is subtracted (the PreNorm trace).
        names: panel labels (default each trace's name); the baseline's label is its ``name``.

    Returns:
        Figure with one Heatmap per trace, ``z`` = trace − baseline on the sublayer axis.
    """
    traces = list(traces)
    if not traces:
        raise ValueError("difference_side_by_side() needs at least one trace besides the baseline")
    names = list(names) if names is not None else [t.name for t in traces]
    labels = {id(t): f"{n} − {baseline.name}" for t, n in zip(traces, names)}
    fig = side_by_side(traces, lambda t, kind: difference_heatmap(t, baseline, kind=kind), names=list(labels.values()), kind=kind)
    top = max((abs(float(t.zmax)) for t in fig.data if t.zmax is not None), default=1.0)
    fig.update_traces(zmin=-top, zmax=top, zmid=0.0)
    for ann, label in zip(fig.layout.annotations, labels.values()):  # the panel titles: what minus what, once
        ann.text = html.escape(label)
    fig.update_layout(title={"text": f"each model minus {html.escape(baseline.name)}: difference in {KIND_TITLES[kind]} "
                                     "(mean over tokens)"}, margin={"t": 90})
    return fig


# -- reading the residual stream: direct logit contributions and the logit lens ----------------
NO_ACTIVATIONS_NOTE = ("A saved trace holds depth weights, not activations: the logit decomposition and the logit lens "
                       "need the model itself (load it with --models DIR, or Probe(model) in a notebook).")


# the legend of _vocab_label's "#N" labels, said once beside the logit decomposition and the logit lens
VOCAB_ID_NOTE = ("#N is token N of the vocabulary shown by its number: it has no printable character on its own "
                 "(with the byte tokenizer, byte N: part of a multi-byte UTF-8 character, or a control character).")


def _vocab_label(text: str, token_id: int) -> str:
    """A predicted token for a label: its text made visible, or ``#id`` when it does not print
    (a byte that is not UTF-8 on its own, a control character)."""
    shown = show_token(text)
    if "\ufffd" in shown or not shown.isprintable():
        return f"#{token_id}"
    return shown


def logit_contributions_chart(lc, k: int = 5, name: str | None = None) -> go.Figure:
    """Each source's direct contribution to the logits of the model's top-``k`` next tokens at one
    token (:meth:`attnres_probe.Probe.logit_contributions`): sources (y) x predicted tokens (x),
    on the diverging scale (red raises a token's logit, blue lowers it). A last row holds the
    sum over sources, which is the model's logit, printed in its cells (the colour scale is
    sized to the contributions, which the sum usually exceeds).

    Returns:
        Figure with one Heatmap: ``z`` [S + 1, k] (contributions, then their sum = the logits),
        ``customdata`` [S + 1, k, 2] = (source weight, contribution).
    """
    ids = [int(i) for i in np.argsort(-lc.logits)[:k]]
    contrib = np.asarray(lc.contributions[:, ids], dtype=np.float64)
    z = np.vstack([contrib, contrib.sum(0, keepdims=True)])
    weights = np.append(np.asarray(lc.weights, dtype=np.float64), np.nan)
    ylabels = [*lc.sources, "sum = logit"]
    custom = np.stack([np.broadcast_to(weights[:, None], z.shape), z], axis=-1)
    m = float(np.nanmax(np.abs(contrib))) if contrib.size else 1.0
    pos = lc.position
    tok = lc.str_tokens[pos] if pos < len(lc.str_tokens) else ""
    parts = [name or "model", f"token {pos} {quote_token(tok)}", f"direct contributions to the top-{len(ids)} next tokens"]
    # the colour scale fits the sources' contributions, so the sum row (the logits, usually larger)
    # saturates it: that row prints its values
    text = [[""] * z.shape[1] for _ in contrib] + [[f"{v:.3g}" for v in z[-1]]]
    heat = go.Heatmap(
        z=z, x=[f"{j + 1}. {_vocab_label(lc.decode([i]), i) if lc.decode else i}" for j, i in enumerate(ids)], y=ylabels,
        text=text, texttemplate="%{text}", textfont={"size": 11},
        customdata=custom, hoverongaps=False, colorscale=DIVERGING_COLORSCALE, zmin=-max(m, 1e-6), zmax=max(m, 1e-6), zmid=0.0,
        hovertemplate="source %{y}<br>next token %{x}<br>contribution %{z:.4~g}<br>source weight %{customdata[0]:.4~g}<extra></extra>",
        colorbar={"title": {"text": "logit"}},
    )
    sum_line = dict(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=len(lc.sources) - 0.5, y1=len(lc.sources) - 0.5,
                    line=BOUNDARY_LINE)
    return go.Figure(data=[heat], layout=dict(
        title=_title_layout(parts), meta={"title_parts": parts}, margin=_title_margin(parts), plot_bgcolor="white",
        shapes=[sum_line], height=max(300, 22 * len(ylabels) + 120 + 20 * len(parts)),
        xaxis={"title": {"text": "predicted next token (by logit)"}, "showgrid": False, "tickangle": 0},
        yaxis={"title": {"text": "source"}, "autorange": "reversed", "showgrid": False},
    ))


def logit_lens_chart(frame: pd.DataFrame, position: int, name: str | None = None, token: str | None = None) -> go.Figure:
    """The logit lens at one token (:meth:`attnres_probe.Probe.logit_lens`): reads (y) x rank (x),
    each cell the token that read's mixed input predicts, coloured by its probability (0..1);
    the token that actually follows is marked with ✓.

    Returns:
        Figure with one Heatmap: ``z`` [R, k] probabilities, ``text`` [R, k] the predicted tokens.
    """
    sub = frame[frame["position"] == position]
    if sub.empty:
        raise ValueError(f"the logit-lens frame has no position {position}; it has {sorted(set(frame['position']))}")
    reads = list(dict.fromkeys(sub["read"]))
    k = int(sub["rank"].max()) + 1
    z = np.full((len(reads), k), np.nan)
    text = np.full((len(reads), k), "", dtype=object)
    for row in sub.itertuples(index=False):
        r = reads.index(row.read)
        z[r, row.rank] = row.prob
        text[r, row.rank] = _vocab_label(str(row.token), int(row.token_id)) + (" ✓" if row.is_next else "")
    what = f"token {position}" + (f" {quote_token(token)}" if token is not None else "")
    parts = [name or "model", what, "what each read predicts next (logit lens)"]
    heat = go.Heatmap(
        z=z, x=[f"top {i + 1}" for i in range(k)], y=reads, text=text, texttemplate="%{text}", textfont={"size": 11},
        colorscale="Blues", zmin=0.0, zmax=1.0, hoverongaps=False, colorbar={"title": {"text": "prob"}},
        hovertemplate="read %{y}<br>%{x}: %{text}<br>probability %{z:.3f}<extra></extra>",
    )
    return go.Figure(data=[heat], layout=dict(
        title=_title_layout(parts), meta={"title_parts": parts}, margin=_title_margin(parts), plot_bgcolor="white",
        height=max(320, 22 * len(reads) + 120 + 20 * len(parts)),
        xaxis={"title": {"text": "rank (✓ = the token that follows)"}, "showgrid": False, "side": "bottom"},
        yaxis={"title": {"text": "read"}, "autorange": "reversed", "showgrid": False},
    ))


# -- attention patterns (hook_pattern) at one token ---------------------------------------------
PATTERN_AXIS_TITLE = "attention weight (softmax over key positions)"  # the chart's quantity (its title's last line)
PATTERN_COLOR = "#4C72B0"


def attention_pattern_chart(
    weights: Sequence[float] | np.ndarray,
    str_tokens: Sequence[str],
    token: int,
    layer: int,
    head: int,
    name: str | None = None,
    color: str | None = None,
) -> go.Figure:
    """One query token's attention pattern in one layer and head (``blocks.{layer}.attn.hook_pattern``
    [batch, head, token, :]): a bar per key position 0..token, the softmax over the positions the
    causal mask lets the token see (they sum to one; later positions are masked, weight 0, and not
    drawn). The y axis starts at 0 and fits the largest weight.

    Args:
        weights: the pattern row over key positions (at least ``token + 1`` values).
        str_tokens: the text's tokens (key labels on the x axis and in the hover).
        token: the query position.
        layer, head: which attention (for the title).
        name: the model's name (the title's first line).
        color: the bars' colour (default one blue for every model).

    Returns:
        Figure with one Bar: ``x`` key positions, ``y`` weights, ``customdata`` the key tokens.
    """
    w = np.asarray(weights, dtype=np.float64)[: token + 1]
    keys = list(range(len(w)))
    toks = [str(str_tokens[k]) if k < len(str_tokens) else "" for k in keys]
    tok = toks[token] if 0 <= token < len(toks) else ""
    parts = [name or "model", f"token {token} {quote_token(tok)} · layer {layer} head {head}", PATTERN_AXIS_TITLE]
    tickvals, ticktext = token_ticks(toks, plot_px=420, positions=len(keys) > 1)
    top = float(np.nanmax(w)) if w.size and np.isfinite(w).any() else 1.0
    bar = go.Bar(
        x=keys, y=w, customdata=[show_token(t) for t in toks], marker={"color": color or PATTERN_COLOR},
        hovertemplate="key %{x} %{customdata}<br>attention weight %{y:.4~g}<extra></extra>",
    )
    return go.Figure(data=[bar], layout=dict(
        title=_title_layout(parts), meta={"title_parts": parts, "layer": layer, "head": head, "token": token},
        margin=_title_margin(parts), plot_bgcolor="white", height=320 + 20 * len(parts), bargap=0.1,
        xaxis={"title": {"text": f"key position (tokens 0..{token} the query sees)"}, "tickvals": tickvals,
               "ticktext": ticktext, "tickangle": 0, "showgrid": False, "range": [-0.5, max(token, 0) + 0.5]},
        yaxis={"title": {"text": "attention weight"}, "range": [0.0, max(top, 1e-6) * 1.05], "gridcolor": "#eee",
               "zeroline": True},
    ))


def token_pattern(trace: DepthTrace, layer: int, head: int, token: int, batch: int = 0,
                  color: str | None = None) -> go.Figure:
    """:func:`attention_pattern_chart` of a trace recorded with ``patterns=True`` (``trace.pattern``)."""
    pos = trace.token_index(token, batch)
    row = trace.pattern(layer, head, token=pos, batch=batch)
    slot, head_slot = trace.pattern_slot(layer, head)  # the model's own layer and head numbers, for the title
    return attention_pattern_chart(row, trace.str_tokens[batch], pos, trace.pattern_layers[slot],
                                   trace.pattern_heads[head_slot], name=trace.name, color=color)


# -- depth profiles ---------------------------------------------------------------------------
LOG_TICKFORMAT = "~g"  # d3: 0.2, 0.05, 1, 20 (trailing zeros dropped)


def log_axis(values) -> dict:
    """Settings of a logarithmic axis over ``values`` on which every tick label is the full number
    (0.2, 0.5, 1, 2), never plotly's small digits.

    Between powers of ten plotly puts "D1" or "D2" ticks on a log axis (it picks them for a range
    of one to a few decades) and labels those with their first digit only, so 0.2 reads "2" under
    the tick "1" of the decade above. A ``tickformat`` makes plotly format every tick in full; the
    ticks are then set at 1, 2 and 5 times each power of ten (``dtick="D2"``: "D1", every digit,
    would be too many full labels to read) over 0.6 to 3.5 decades of data, at the powers of ten
    only over more, and left to plotly below (its "L" ticks: evenly spaced values, also labelled in
    full). Unlabelled minor ticks and grid lines mark the other digits.
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v) & (v > 0)]
    out: dict = {"type": "log", "tickformat": LOG_TICKFORMAT}
    if v.size:
        span = math.log10(float(v.max()) / float(v.min()))
        if span > 3.5:
            out["dtick"] = 1
        elif span >= 0.6:
            out.update(dtick="D2", minor={"ticks": "outside", "ticklen": 3, "showgrid": True, "dtick": "D1",
                                          "gridcolor": "rgba(255,255,255,0.45)"})
    return out


def _log_panels(layout: dict, ylabels: dict[int, str], values: dict[int, list]) -> None:
    """Give each panel (column) of a one-row :func:`grid_layout` its "<label> (log)" y axis over
    the values drawn there (:func:`log_axis`)."""
    for col, ylabel in ylabels.items():
        axis = layout[_axis_key(cell_axes(1, col, len(ylabels))["yaxis"])]
        axis.update(title={"text": f"{ylabel} (log)"}, **log_axis(np.concatenate(values[col]) if values[col] else []))


def _line_names(traces: Sequence[DepthTrace]) -> list[str]:
    if not traces:
        raise ValueError("pass at least one DepthTrace")
    return unique_names([t.name for t in traces])


def magnitudes(traces: Sequence[DepthTrace]) -> go.Figure:
    """Hidden-state magnitude by depth, every trace in its own colour.

    Left: RMS of each read's mixed input h (``rms_in`` [B, P, R], mean over real tokens) by read.
    Right: RMS of each written source v (``rms_out`` [B, P, L+1]: embed, then every sublayer
    output). Solid lines on both panels (the legend's colour names the model); both y axes are
    logarithmic, labelled in full numbers (:func:`log_axis`).

    Returns:
        Figure with two Scatter traces per model (``rms_in`` then ``rms_out``), legend grouped by model.
    """
    names = _line_names(traces)
    colors = model_colors(names)
    layout = grid_layout(1, 2, subplot_titles=("RMS of mixed input h, by read", "RMS of written source v (embed, sublayer outputs)"))
    data, values = [], {1: [], 2: []}
    for t, name in zip(traces, names):
        reads, srcs = metrics.read_profile(t), metrics.source_profile(t)
        line = {"color": colors[name]}
        y_in, y_out = reads["rms_in"].to_numpy(), srcs["rms_out"].to_numpy()
        values[1].append(y_in), values[2].append(y_out)
        data.append(go.Scatter(
            x=list(reads.index), y=y_in, name=name, legendgroup=name, mode="lines+markers",
            line=line, hovertemplate=f"{name}<br>read %{{x}}<br>rms(h) %{{y:.4~g}}<extra></extra>", **cell_axes(1, 1, 2),
        ))
        data.append(go.Scatter(
            x=list(srcs.index), y=y_out, name=name, legendgroup=name, showlegend=False,
            mode="lines+markers", line=line,
            hovertemplate=f"{name}<br>source %{{x}}<br>rms(v) %{{y:.4~g}}<extra></extra>", **cell_axes(1, 2, 2),
        ))
    _log_panels(layout, {1: "rms(h)", 2: "rms(v)"}, values)  # the corpus page's words (magnitude_bands)
    layout.update(title={"text": "Magnitudes by depth"}, height=420)
    return go.Figure(data=data, layout=layout)


def gradient_norms(traces: Sequence[DepthTrace]) -> go.Figure:
    """Gradient norms by depth, every trace in its own colour.

    Left: per-token ‖∂Loss/∂h‖ at each read's mixed input (``grad_in`` [B, P, R], mean over real
    tokens). Right: each sublayer's parameter-gradient norm (``param_grad`` [L]). Solid lines, log
    y axes labelled in full numbers (:func:`log_axis`).
    A trace recorded without backward draws no line and gets a note "<name>: no gradients
    recorded" on that panel instead.

    Returns:
        Figure with up to two Scatter traces per model (only those with finite values).
    """
    names = _line_names(traces)
    colors = model_colors(names)
    layout = grid_layout(1, 2, subplot_titles=("‖∂Loss/∂h‖ per token at mixed inputs, by read", "parameter-gradient norm per sublayer"))
    notes = layout.get("annotations", [])
    missing = {1: 0, 2: 0}
    shown = set()
    data, values = [], {1: [], 2: []}
    for t, name in zip(traces, names):
        reads = metrics.read_profile(t)
        panels = (
            (1, list(reads.index), reads["grad_in"].to_numpy(), "read", "‖∂L/∂h‖"),
            (2, t.sublayer_labels, np.asarray(t.param_grad, dtype=np.float64), "sublayer", "‖∂L/∂θ‖"),
        )
        for col, x, y, what, sym in panels:
            if not np.isfinite(y).any():
                sfx = "" if col == 1 else "2"
                notes.append(_note(f"{name}: no gradients recorded", f"x{sfx} domain", f"y{sfx} domain", 0.9 - 0.08 * missing[col]))
                missing[col] += 1
                continue
            values[col].append(y)
            data.append(go.Scatter(
                x=x, y=y, name=name, legendgroup=name, showlegend=name not in shown, mode="lines+markers",
                line={"color": colors[name]},
                hovertemplate=f"{name}<br>{what} %{{x}}<br>{sym} %{{y:.4~g}}<extra></extra>", **cell_axes(1, col, 2),
            ))
            shown.add(name)
    _log_panels(layout, {1: "‖∂L/∂h‖", 2: "‖∂L/∂θ‖"}, values)  # the corpus page's words (gradient_bands)
    layout.update(title={"text": "Gradient norms by depth"}, annotations=notes, height=420)
    return go.Figure(data=data, layout=layout)


# -- corpus aggregates (CorpusStats) ---------------------------------------------------------
def corpus_heatmap(stats, kind: str = "weights", name: str | None = None, value: str = "mean") -> go.Figure:
    """Mean depth routing over a corpus, reads (y) x sources (x), with each cell's spread.

    Each cell is the mean over every real token of the corpus (``stats.mean(kind)``); the hover
    adds the standard deviation over tokens and the count, so a mean of 0.3 made of 0.3s reads
    differently from one made of 0s and 1s. Unavailable cells stay blank.

    Args:
        stats: a :class:`~attnres_probe.corpus.stats.CorpusStats`.
        kind: ``"weights"`` | ``"contrib"`` | ``"logits"``.
        name: the model's label (default ``stats.name``).
        value: ``"mean"`` colours the mean; ``"sd"`` colours the standard deviation over tokens
            (the spread, from 0 up), with the mean in the hover.

    Returns:
        Figure with one Heatmap: ``z`` [R, S] means (or sds), ``customdata`` [R, S, 3] = (mean, sd, count).
    """
    _check_kind(kind)
    if value not in ("mean", "sd"):
        raise ValueError(f"value is {value!r}; accepted values are 'mean' and 'sd'")
    trace = stats.to_trace()
    key = {"weights": "depth_weights", "contrib": "contrib", "logits": "logits"}[kind]
    mean = np.asarray(stats.mean(key), np.float64)
    mean = np.where(np.isinf(mean), np.nan, mean)
    sd = np.sqrt(np.asarray(stats.var(key), np.float64))
    sd_label = "sd over tokens"
    if trace.residual in COEFFICIENT_RULES and kind == "weights":
        # the mean coefficients c̄ over their sum Σc̄: PreNorm's 1/k and DenseFormer's (constant per token) exactly;
        # for dynamic Hyper-Connections the normalised mean, not the mean of normalised rows. The sd is put on the
        # same scale (sd of c, over Σc̄), so that colour, mean and sd speak of one quantity.
        sd = sd / row_sum(mean)[..., None]
        mean = implied_weights(mean)
        sd_label = "sd over tokens of c/Σc̄"
    count = np.asarray(stats.stats[key].count, np.float64)
    name = name or stats.name
    z = mean if value == "mean" else sd
    if value == "mean":
        colors = _color_range(kind, z)
    else:
        top = float(np.nanmax(z)) if np.isfinite(z).any() else 1.0
        colors = {"zmin": 0.0, "zmax": max(top, 1e-6)}
    fig = go.Figure(
        go.Heatmap(
            z=z, x=trace.source_labels, y=trace.read_labels, customdata=np.stack([mean, sd, count], axis=-1),
            hovertemplate="read %{y}<br>source %{x}<br>mean %{customdata[0]:.4~g}<br>" + sd_label + " %{customdata[1]:.3~g}"
            "<br>tokens %{customdata[2]:.0f}<extra></extra>",
            hoverongaps=False, colorscale=COLORSCALES[kind] if value == "mean" else "Greys",
            colorbar={"title": {"text": kind if value == "mean" else "sd"}}, **colors,
        )
    )
    notes = _empty_note(trace, kind, z)
    parts = [name, f"{'mean' if value == 'mean' else 'sd'} over {stats.n_tokens} tokens in {stats.n_windows} windows",
             kind_title(trace, kind)]
    fig.update_layout(
        title=_title_layout(parts), meta={"title_parts": parts}, margin=_title_margin(parts),
        shapes=_read_block_lines(trace), annotations=notes, plot_bgcolor="white",
        height=max(320, 24 * len(trace.read_labels) + 120 + 20 * len(parts)),
        xaxis={"title": {"text": "source"}, "showgrid": False, "tickangle": source_tickangle(len(trace.source_labels))},
        yaxis={"title": {"text": "read"}, "autorange": "reversed", "showgrid": False},
    )
    return fig


def corpus_side_by_side(stats: Sequence, kind: str = "weights", names: Sequence[str] | None = None, value: str = "mean") -> go.Figure:
    """:func:`corpus_heatmap` of several models in a row, as :func:`side_by_side` (``value="sd"``: the spreads,
    on one shared range)."""
    stats = list(stats)
    if not stats:
        raise ValueError("corpus_side_by_side() needs at least one CorpusStats")
    names = list(names) if names is not None else [s.name for s in stats]
    by_id = {id(s): n for s, n in zip(stats, names)}
    fig = side_by_side(stats, lambda s, kind: corpus_heatmap(s, kind, name=by_id[id(s)], value=value), names=names, kind=kind)
    if value == "sd":
        top = max(float(t.zmax) for t in fig.data)
        fig.update_traces(zmin=0.0, zmax=top)
        fig.update_layout(title={"text": f"spread over tokens (sd) of the {KIND_TITLES.get(kind, kind)}"})
    return fig


BAND_NOTE = ("lines: mean over {windows}; bands: 95% interval of that mean, computed on the log scale "
             "(mean ×/÷ exp(1.96·se/mean)), so it stays above zero")


def _windows_words(counts: Sequence[int]) -> str:
    """"N windows" when every model has N, else "windows (N₁–N₂ per model)"."""
    counts = sorted({int(c) for c in counts})
    if not counts:
        return "windows"
    return f"{counts[0]} windows" if len(counts) == 1 else f"windows ({counts[0]}–{counts[-1]} per model)"


def _hex_rgba(color: str, alpha: float) -> str:
    c = color.lstrip("#")
    return f"rgba({int(c[0:2], 16)},{int(c[2:4], 16)},{int(c[4:6], 16)},{alpha})"


def _band_figure(stats: Sequence, names: Sequence[str] | None, panels: list[tuple[str, str, str]], title: str) -> go.Figure:
    """Line + band per model on each panel; panels = [(profile name, subplot title, y label)].

    Bands are :meth:`CorpusStats.profile`'s intervals (the log-scale interval of the mean over
    windows, positive by construction); the title says so, with the number of windows, and
    each point's hover repeats it."""
    stats = list(stats)
    if not stats:
        raise ValueError("pass at least one CorpusStats")
    names = unique_names(list(names) if names is not None else [s.name for s in stats])
    colors = model_colors(names)
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[1] for p in panels])
    notes = list(fig.layout.annotations)
    counts = []
    for col, (prof_name, _, ylabel) in enumerate(panels, start=1):
        missing = 0
        for s, name in zip(stats, names):
            prof = s.profile(prof_name)
            if not np.isfinite(prof["mean"].to_numpy(float)).any():
                sfx = "" if col == 1 else str(col)
                notes.append(_note(f"{name}: not recorded", f"x{sfx} domain", f"y{sfx} domain", 0.9 - 0.08 * missing))
                missing += 1
                continue
            x = list(prof.index)
            lo, hi = prof["low"].to_numpy(float), prof["high"].to_numpy(float)
            counts += [int(c) for c in prof["windows"].to_numpy() if c > 0]
            fig.add_trace(go.Scatter(x=x + x[::-1], y=np.concatenate([hi, lo[::-1]]), fill="toself", mode="lines",
                                     line={"width": 0}, fillcolor=_hex_rgba(colors[name], 0.2), hoverinfo="skip",
                                     legendgroup=name, showlegend=False, name=f"{name} band"), row=1, col=col)
            fig.add_trace(go.Scatter(
                x=x, y=prof["mean"].to_numpy(float), name=name, legendgroup=name, showlegend=col == 1, mode="lines+markers",
                line={"color": colors[name]}, customdata=np.stack([lo, hi, prof["windows"].to_numpy(float)], axis=-1),
                hovertemplate=f"{html.escape(name)}<br>%{{x}}<br>{ylabel} %{{y:.4~g}} (mean over %{{customdata[2]:.0f}} windows)"
                "<br>95% interval of the mean [%{customdata[0]:.4~g}, %{customdata[1]:.4~g}] (log scale)<extra></extra>",
            ), row=1, col=col)
    for col, (_, _, ylabel) in enumerate(panels, start=1):
        axis = "x" if col == 1 else f"x{col}"
        values = [np.asarray(tr.y, float) for tr in fig.data if (tr.xaxis or "x") == axis]  # lines and bands
        fig.update_yaxes(title_text=f"{ylabel} (log)", **log_axis(np.concatenate(values) if values else []), row=1, col=col)
    note = BAND_NOTE.format(windows=_windows_words(counts))
    fig.update_layout(title={"text": f"{title}<br><span style='font-size:12px'>{note}</span>"},
                      meta={"band_note": note}, margin={"t": 110}, annotations=notes, height=460)
    return fig


def magnitude_bands(stats: Sequence, names: Sequence[str] | None = None) -> go.Figure:
    """Magnitudes by depth over a corpus: RMS of mixed inputs by read and of written sources, each a
    line (mean over windows of the window's mean) with a band (95% interval of that mean, on the log scale)."""
    return _band_figure(stats, names, [("rms_in", "RMS of mixed input h, by read", "rms(h)"),
                                       ("rms_out", "RMS of written source v", "rms(v)")], "Magnitudes by depth")


def gradient_bands(stats: Sequence, names: Sequence[str] | None = None) -> go.Figure:
    """Gradient norms by depth over a corpus: ‖∂Loss/∂h‖ by read and parameter-gradient norm by
    sublayer, each a line (mean over windows) with a band (95% interval of that mean, on the log scale)."""
    return _band_figure(stats, names, [("grad_in", "‖∂Loss/∂h‖ at mixed inputs, by read", "‖∂L/∂h‖"),
                                       ("param_grad", "parameter-gradient norm per sublayer", "‖∂L/∂θ‖")], "Gradient norms by depth")


# -- ablation and tables ----------------------------------------------------------------------
ABLATION_COLUMNS = ("read", "source", "mass", "contrib", "delta_loss")
ABLATION_BAR_COLORS = ("#D62728", "#FF9896", "#8C564B")  # one per ablation mode


def ablation_chart(frame: pd.DataFrame, read: str | None = None) -> go.Figure:
    """Δloss from ablating each source, beside how much routing mass that source had, at one read.

    Args:
        frame: one row per (read, source) with columns ``read``, ``source``, ``mass`` (mean depth
            weight), ``contrib`` (mean contribution share), ``delta_loss`` (mean loss change when
            the source is ablated at that read), as :func:`attnres_probe.ablation.ablate` returns;
            with a ``mode`` column holding several modes, one bar per mode in each group.
        read: which read to show; default the first read in ``frame``.

    Returns:
        Figure with three rows sharing the source axis: bars of Δloss per source (``y``), markers
        of the routing mass (``y2``: the mean normalised depth weight, AttnRes's α or another rule's
        c/Σc; 0..1, widened for coefficients outside it) and of the contribution share c (``y3``,
        its own axis: shares can be negative or above one).
    """
    missing = [c for c in ABLATION_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"ablation frame lacks columns {missing}; it needs {list(ABLATION_COLUMNS)}")
    layout = grid_layout(3, 1, shared_xaxes=True, row_heights=[0.5, 0.25, 0.25], vertical_spacing=0.06)
    if frame.empty:
        layout.update(title={"text": "Ablation"}, annotations=[_note("no ablation results", "paper", "paper")])
        return go.Figure(layout=layout)
    reads = list(dict.fromkeys(frame["read"]))
    read = reads[0] if read is None else read
    if read not in reads:
        raise KeyError(f"read {read!r} is not in the ablation frame; it has {reads}")
    rows = frame[frame["read"] == read]
    modes = list(dict.fromkeys(rows["mode"])) if "mode" in rows.columns else [None]
    data = []
    for i, mode in enumerate(modes):
        sub = rows if mode is None else rows[rows["mode"] == mode]
        label = "Δloss when ablated" if mode is None else f"Δloss when ablated ({mode})"
        data.append(go.Bar(x=[str(s) for s in sub["source"]], y=sub["delta_loss"].to_numpy(), name=label,
                           marker_color=ABLATION_BAR_COLORS[i % len(ABLATION_BAR_COLORS)],
                           hovertemplate=f"source %{{x}}<br>{label} %{{y:.4~g}}<extra></extra>", **cell_axes(1, 1, 1)))
    rows = rows.drop_duplicates("source")  # mass and contrib do not depend on the mode
    x = [str(s) for s in rows["source"]]
    for r, (col, label, color, symbol) in enumerate(
        (("mass", "routing mass (normalised weight)", "#1F77B4", "circle"), ("contrib", "contribution share c", "#2CA02C", "diamond")), start=2
    ):
        data.append(go.Scatter(x=x, y=rows[col].to_numpy(), name=label, mode="markers", marker={"color": color, "size": 11, "symbol": symbol},
                               hovertemplate=f"source %{{x}}<br>{label} %{{y:.4~g}}<extra></extra>", **cell_axes(r, 1, 1)))
    c = rows["contrib"].to_numpy(dtype=float)
    lo = min(0.0, float(np.nanmin(c)) if np.isfinite(c).any() else 0.0)
    hi = max(1.0, float(np.nanmax(c)) if np.isfinite(c).any() else 1.0)
    pad = 0.05 * (hi - lo)
    layout["yaxis"].update(title={"text": "Δloss"}, zeroline=True, tickformat=".3~g")
    m = rows["mass"].to_numpy(dtype=float)
    m_lo = min(0.0, float(np.nanmin(m)) if np.isfinite(m).any() else 0.0)
    m_hi = max(1.0, float(np.nanmax(m)) if np.isfinite(m).any() else 1.0)
    layout["yaxis2"].update(title={"text": "mass"}, range=[m_lo - 0.05 * (m_hi - m_lo), m_hi + 0.05 * (m_hi - m_lo)],
                            tickformat=".2~f", nticks=4, zeroline=True, zerolinecolor="#999")
    layout["yaxis3"].update(title={"text": "share c"}, range=[lo - pad, hi + pad], zeroline=True, zerolinecolor="#999",
                            tickformat=".2~f", nticks=4)
    layout["xaxis3"].update(title={"text": "source"})
    layout.update(
        title={"text": f"Ablation at read {read}: Δloss per source vs routing mass and contribution share"},
        barmode="group", height=520,
    )
    return go.Figure(data=data, layout=layout)


WEIGHT_EFFECT_COLUMNS = ("embed_weight", "embed_delta", "recent_weight", "recent_delta", "embed_uniform", "recent_uniform")


def weight_effect_chart(effects: Mapping[str, pd.DataFrame], colors: Mapping[str, str] | None = None) -> go.Figure:
    """Routing weight beside causal effect in the deep reads, for every model on one chart.

    Each point is one deep read of one model and one source (the embedding: circles; the most recent
    source: triangles): x its mean normalised weight over its share under the uniform reference on
    the model's own axis (1 = what uniform weights give it, a dashed line; Block's blocks count their
    sublayers, as everywhere), y the loss change when that source alone is removed from the read.
    Weight predicts effect where points rise to the right.

    Args:
        effects: model name -> :func:`attnres_probe.ablation.weight_beside_effect` (one row per deep read).
        colors: model name -> colour (default :func:`model_colors`).
    """
    for name, frame in effects.items():
        missing = [c for c in WEIGHT_EFFECT_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"weight-effect frame of {name!r} lacks columns {missing}; pass what "
                             "ablation.weight_beside_effect returns")
    colors = dict(colors or model_colors(list(effects)))
    data = []
    for name, frame in effects.items():
        reads = [str(r) for r in frame.index]
        for col, label, symbol in (("embed", "embedding", "circle"), ("recent", "most recent source", "triangle-up")):
            w = frame[f"{col}_weight"].to_numpy(float)
            u = frame[f"{col}_uniform"].to_numpy(float)
            data.append(go.Scatter(
                x=w / u, y=frame[f"{col}_delta"].to_numpy(float), mode="markers", name=f"{name} · {label}",
                legendgroup=name, marker={"color": colors.get(name), "symbol": symbol, "size": 10, "opacity": 0.85},
                customdata=np.stack([w, u], axis=-1), text=reads,
                hovertemplate=(f"{name} · {label} at read %{{text}}<br>weight %{{customdata[0]:.3f}} "
                               "(uniform %{customdata[1]:.3f}; ×%{x:.2f})<br>Δloss when removed %{y:+.4~g} nats<extra></extra>"),
            ))
    layout = {
        "title": {"text": "Weight beside effect in the deep reads: routing weight vs loss change when the source is removed"},
        "xaxis": {"title": {"text": "normalised weight ÷ its uniform share (1 = uniform)"}, "zeroline": False},
        "yaxis": {"title": {"text": "Δloss when removed (nats per token)"}, "zeroline": True, "zerolinecolor": "#999",
                  "tickformat": ".3~g"},
        "shapes": [{"type": "line", "x0": 1, "x1": 1, "y0": 0, "y1": 1, "yref": "paper", "layer": "below",
                    "line": {"dash": "dash", "color": "#888"}}],
        "annotations": [{"text": "uniform", "x": 1, "y": 1, "yref": "paper", "showarrow": False, "yanchor": "bottom",
                         "font": {"size": 11, "color": "#555"}}],
        # the legend on the right, one entry a line: two per model, so five models would wrap a horizontal
        # legend onto the x axis
        "height": 480, "legend": {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"},
    }
    if not data:
        layout["annotations"].append(_note("no weight-effect results", "paper", "paper"))
    return go.Figure(data=data, layout=layout)


def format_value(v) -> str:
    if isinstance(v, (float, np.floating)):
        return "—" if np.isnan(v) else f"{v:.4g}"
    return str(v)


def metric_table_figure(frame: pd.DataFrame) -> go.Figure:
    """A DataFrame (e.g. :func:`attnres_probe.metrics.compare`) as a plotly Table; numbers to 4 significant digits, NaN as —."""
    header = [str(frame.index.name or ""), *map(str, frame.columns)]
    cells = [[str(i) for i in frame.index], *[[format_value(v) for v in frame[c]] for c in frame.columns]]
    fig = go.Figure(go.Table(header={"values": header, "align": "left"}, cells={"values": cells, "align": "left"}))
    fig.update_layout(height=60 + 28 * (len(frame) + 1), margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


# -- HTML ------------------------------------------------------------------------------------
FLAG_STYLE = "background:#fff3cd;color:#8a4b00;border:1px solid #e0b252;padding:4px 8px;margin-top:6px"


def trace_summary_html(trace: DepthTrace, n_tokens: int = 40) -> str:
    """Compact HTML card of a trace (``DepthTrace._repr_html_``).

    Shows name, residual, sequences, tokens, reads × sources, mean loss, whether gradients were
    recorded, the depth-mixing backend and schedule (when the trace records them), the flags (in
    a warning colour, only when there are any) and the first ``n_tokens`` tokens of the first
    sequence. Every string taken from the trace is escaped with :func:`html.escape`.
    """
    s = trace.summary()
    e = lambda v: html.escape(str(v), quote=True)  # noqa: E731
    loss = "n/a" if np.isnan(s["mean_loss"]) else f"{s['mean_loss']:.4f}"
    rows = [
        ("residual", s["residual"]),
        ("sequences", s["sequences"]),
        ("tokens", s["tokens"]),
        ("reads × sources", f"{s['reads']} × {s['sources']}"),
        ("mean loss", loss),
        ("gradients", "recorded" if s["gradients"] else "not recorded"),
    ]
    backend = trace.meta.get("backend")
    if backend:  # what computed the depth mixing (older traces do not say)
        schedule = trace.meta.get("schedule")
        rows.append(("depth mixing", f"{backend} kernels" + (f", {schedule.replace('_', '-')} schedule" if schedule else "")))
    body = "".join(f"<tr><th style='text-align:left;padding-right:12px'>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows)
    toks = trace.str_tokens[0] if trace.str_tokens else []
    text = e("".join(toks[:n_tokens])) + ("…" if len(toks) > n_tokens else "")
    flags = ""
    if s["flags"]:
        items = "".join(f"<li>{e(f)}</li>" for f in s["flags"])
        flags = f"<div class='attnres-flags' style='{FLAG_STYLE}'><b>flags</b><ul style='margin:2px 0'>{items}</ul></div>"
    return (
        "<div class='attnres-trace' style='font-family:sans-serif;font-size:13px'>"
        f"<div><b>DepthTrace</b> {e(s['name'])}</div>"
        f"<table>{body}</table>{flags}"
        f"<div style='margin-top:6px'>text: <code style='white-space:pre-wrap'>{text}</code></div>"
        "</div>"
    )


# -- routing over training (train --probe-every) ----------------------------------------------
OVER_TRAINING_ROWS = (
    ("embed_weight", "weight on the embedding"),
    ("recent_mass", "mass on the most recent source"),
    ("entropy", "routing entropy (1 = uniform)"),
    ("rms_in", "RMS of the mixed input"),
)
SHARE_ROWS = ("recent_mass", "entropy")  # with the embedding weight: PreNorm's implied values where a history lacks them


def over_training_shown(n_reads: int) -> list[int]:
    """The reads drawn at first in :func:`over_training` (the others one legend click away): the
    first, a middle and the last layer's attention read, the last MLP read and the final read."""
    last = n_reads - 1
    picks = [0, 2 * ((last // 2) // 2), max(0, last - 2), max(0, last - 1), last]
    return sorted(set(picks))


def _implied_row(key: str, n_reads: int) -> np.ndarray:
    """PreNorm's value of an over-training routing row at each read: read r sees k = r + 1 sources with
    weight 1/k each (the embedding and the most recent source both get 1/k; the entropy of a uniform
    mixture is 1, undefined where k = 1)."""
    k = np.arange(1, n_reads + 1, dtype=float)
    if key == "entropy":
        return np.where(k > 1, 1.0, np.nan)
    return 1.0 / k


def over_training(histories: dict[str, Sequence[dict]], read_labels: Sequence[str] | None = None) -> go.Figure:
    """How routing changes during training: per read, against the training step, one column per run.

    Args:
        histories: run name -> its probe summaries (``train_log.json``'s ``probes.history``,
            recorded with ``train --probe-every N``; see :mod:`attnres_probe.training.probes`).
        read_labels: the reads' labels (default ``L0.attn`` … ``final`` from the history's length).

    Returns:
        Figure: rows = embedding weight, recent-source mass, entropy, mixed-input RMS (one line
        per read: one colour per layer, its MLP read dotted, the final read black; the reads of
        :func:`over_training_shown` drawn, the others one legend click away), and the gradient
        spread (the CV of the per-read gradient norms, one line); columns = runs. PreNorm's routing
        rows are its implied weights, 1/k (a history recorded before the probes measured them
        gets them drawn from the reads' source counts, with a note).
    """
    names = list(histories)
    if not names:
        raise ValueError("over_training() needs at least one run's probe history")
    for name in names:
        if not histories[name]:
            raise ValueError(f"run {name!r} has no routing probes (train it with --probe-every N)")
    rows = [*OVER_TRAINING_ROWS, ("act_grad_cv", "gradient spread (CV over reads)")]
    fig = make_subplots(  # one y axis per row: a height means the same value in every run
        rows=len(rows), cols=len(names), shared_xaxes=True, shared_yaxes=True, column_titles=names,
        row_titles=None, vertical_spacing=0.05, horizontal_spacing=0.04,
    )
    import plotly.colors as pc

    for c, name in enumerate(names, start=1):
        hist = sorted(histories[name], key=lambda h: h["step"])
        steps = [h["step"] for h in hist]
        n_reads = len(hist[0]["rms_in"])
        labels = list(read_labels) if read_labels is not None and len(read_labels) == n_reads else [
            *(f"L{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}" for i in range(n_reads - 1)), "final"]
        n_layers = max(1, (n_reads - 1) // 2)
        # one colour per layer (its attention and MLP reads share it; the MLP's line is dotted), the final read black:
        # 8 layers give 8 distinct shades where 17 reads in one ramp looked alike
        shades = pc.sample_colorscale("Turbo", [0.05 + 0.9 * li / max(1, n_layers - 1) for li in range(n_layers)])
        styles = [{"color": shades[min(r // 2, n_layers - 1)], "dash": "solid" if r % 2 == 0 else "dot", "width": 1.6}
                  for r in range(n_reads - 1)] + [{"color": "#111", "dash": "solid", "width": 2.4}]
        shown = set(over_training_shown(n_reads))
        no_weights = not any(v is not None and np.isfinite(v) for h in hist for v in h.get("embed_weight") or [])
        for rw, (key, title) in enumerate(rows, start=1):
            if key == "act_grad_cv":
                fig.add_trace(go.Scatter(x=steps, y=[h.get(key) for h in hist], mode="lines+markers", name=f"{name} · grad CV",
                                         line={"color": "#444"}, showlegend=False,
                                         hovertemplate="step %{x}<br>CV %{y:.3f}<extra>" + html.escape(name) + "</extra>"), row=rw, col=c)
            else:
                values = np.array([[np.nan if v is None else v for v in h[key]] for h in hist], dtype=float)  # (steps, R)
                k = (rw - 1) * len(names) + c
                ref = {"xref": f"x{'' if k == 1 else k} domain", "yref": f"y{'' if k == 1 else k} domain"}
                if key in SHARE_ROWS + ("embed_weight",) and no_weights:
                    # a history recorded before the probes measured PreNorm's implied weights: draw them (read r sees
                    # r + 1 sources, each with weight 1/(r + 1); its entropy is that of the uniform mixture, 1)
                    values = np.tile(_implied_row(key, n_reads), (len(hist), 1))
                    if key == "embed_weight":
                        fig.add_annotation(text="PreNorm: implied weights 1/k (every source added with weight 1)",
                                           x=0.5, y=1.0, yanchor="bottom", showarrow=False,
                                           font={"color": "#777", "size": 10}, **ref)
                if not np.isfinite(values).any():
                    fig.add_annotation(text="not recorded", x=0.5, y=0.5, showarrow=False, font={"color": "#777"}, **ref)
                for r in range(n_reads):
                    fig.add_trace(go.Scatter(
                        x=steps, y=values[:, r], mode="lines", line=styles[r],
                        name=labels[r], legendgroup=labels[r], showlegend=(rw == 1 and c == 1),
                        visible=True if r in shown else "legendonly",
                        hovertemplate=f"{html.escape(labels[r])}<br>step %{{x}}<br>%{{y:.3f}}<extra>{html.escape(name)}</extra>",
                    ), row=rw, col=c)
            if c == 1:
                fig.update_yaxes(title={"text": title, "font": {"size": 11}}, row=rw, col=c)
        fig.update_xaxes(title={"text": "training step"}, row=len(rows), col=c)
    fig.update_yaxes(tickformat=".3~g")  # a flat row (PreNorm's entropy, 1 to rounding) keeps short ticks
    fig.update_layout(height=190 * len(rows) + 120,
                      title={"text": "Routing over training<br><span style='font-size:12px'>each line one read's mean over the "
                                     "held-out probe windows of one run (no interval); the same y scale in every column</span>"},
                      plot_bgcolor="white",
                      legend={"title": {"text": "read<br><span style='font-size:11px'>click: show or hide<br>"
                                                "double-click: only this one</span>"}, "groupclick": "togglegroup"})
    return fig


# -- DepthTrace's notebook methods ------------------------------------------------------------
# trace.py is the record and never imports this module; the conveniences that README.md shows
# (``trace.heatmap(token=5)``, ``trace.mean_heatmap()``, the Jupyter card) are bound onto the
# class here, when this module is imported (the package's ``attnres_probe.DepthTrace`` and
# ``attnres_probe.Probe`` import it). Each one calls the function of this module named in
# ``attnres_probe.trace.PLOT_METHODS``.
def _heatmap_method(self: DepthTrace, token: int = 0, batch: int = 0, kind: str = "weights", expanded: bool = False) -> go.Figure:
    """Per-token depth heatmap (reads x sources) as a plotly Figure (:func:`attnres_probe.figures.token_heatmap`)."""
    return token_heatmap(self, token=token, batch=batch, kind=kind, expanded=expanded)


def _mean_heatmap_method(self: DepthTrace, kind: str = "weights", expanded: bool = False) -> go.Figure:
    """Mean depth heatmap over tokens as a plotly Figure (:func:`attnres_probe.figures.mean_heatmap`)."""
    return mean_heatmap(self, kind=kind, expanded=expanded)


def _source_heatmap_method(self: DepthTrace, source: int | str = 0, batch: int = 0, kind: str = "weights") -> go.Figure:
    """Token x read heatmap of one source's weight (source 0: embedding retention per token;
    :func:`attnres_probe.figures.source_heatmap`)."""
    return source_heatmap(self, source=source, batch=batch, kind=kind)


def _magnitudes_method(self: DepthTrace) -> go.Figure:
    """RMS of mixed inputs and sublayer outputs by depth, as a plotly Figure (:func:`attnres_probe.figures.magnitudes`)."""
    return magnitudes([self])


def _gradients_method(self: DepthTrace) -> go.Figure:
    """Gradient norms by depth (per-token at mixed inputs, and per sublayer's parameters;
    :func:`attnres_probe.figures.gradient_norms`)."""
    return gradient_norms([self])


def _repr_html_method(self: DepthTrace) -> str:
    """The trace's summary card in Jupyter (:func:`attnres_probe.figures.trace_summary_html`)."""
    return trace_summary_html(self)


TRACE_METHODS = {
    "heatmap": _heatmap_method,
    "mean_heatmap": _mean_heatmap_method,
    "source_heatmap": _source_heatmap_method,
    "magnitudes": _magnitudes_method,
    "gradients": _gradients_method,
    "_repr_html_": _repr_html_method,
}
for _name, _method in TRACE_METHODS.items():
    _method.__name__, _method.__qualname__ = _name, f"DepthTrace.{_name}"
    setattr(DepthTrace, _name, _method)
del _name, _method
