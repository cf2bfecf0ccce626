"""Every chart of attnres-probe, built once here (plotly ``graph_objects``).

The notebook API (``DepthTrace.heatmap`` etc.), the Dash dashboard and the HTML reports all
call these functions; nobody draws the same chart twice.

Conventions shared by every chart:

- Heatmaps put reads on y (first read at the top) and sources on x, on the trace's common
  source axis (``trace.source_labels``) or, with ``expanded=True``, the L+1 sublayer axis.
  Unavailable cells are NaN and stay blank (never drawn as zero) and have no hover.
- Weights and contribution shares use one sequential scale fixed to 0..1
  (:data:`WEIGHT_COLORSCALE`); logits use a diverging scale centred on 0 (:data:`LOGIT_COLORSCALE`).
- Each model name gets one colour (:func:`model_colors`), the same in every line chart.
- Text from a trace (token strings, names, flags) goes into plotly as data, which plotly
  renders safely; the one function here that writes HTML, :func:`trace_summary_html`, escapes
  every such string with :func:`html.escape`.
"""

from __future__ import annotations

import html
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnres_probe import metrics
from attnres_probe.numeric import token_mean
from attnres_probe.trace import DepthTrace, unique_names

__all__ = [
    "BASELINE_COLOR",
    "LOGIT_COLORSCALE",
    "MODEL_PALETTE",
    "WEIGHT_COLORSCALE",
    "ablation_chart",
    "corpus_heatmap",
    "corpus_side_by_side",
    "gradient_bands",
    "gradient_norms",
    "magnitude_bands",
    "magnitudes",
    "mean_heatmap",
    "metric_table_figure",
    "model_colors",
    "side_by_side",
    "source_heatmap",
    "token_heatmap",
    "trace_summary_html",
]

# -- the project's colours, defined once ------------------------------------------------------
WEIGHT_COLORSCALE = "Viridis"  # weights and contribution shares, zmin=0, zmax=1
LOGIT_COLORSCALE = "RdBu_r"  # depth logits, symmetric around 0
COLORSCALES = {"weights": WEIGHT_COLORSCALE, "contrib": WEIGHT_COLORSCALE, "logits": LOGIT_COLORSCALE}
KIND_TITLES = {"weights": "depth weight α", "logits": "depth logit z", "contrib": "contribution share c"}
BASELINE_COLOR = "#7F7F7F"  # PreNorm
# fixed colours for the three residual modes' default names; other names take MODEL_PALETTE in order
FIXED_COLORS = {"prenorm": BASELINE_COLOR, "full": "#1F77B4", "block": "#FF7F0E"}
MODEL_PALETTE = ("#2CA02C", "#D62728", "#9467BD", "#8C564B", "#E377C2", "#17BECF", "#BCBD22", "#1F77B4", "#FF7F0E")
BOUNDARY_LINE = {"color": "black", "width": 2}
HOVER_CELLS = (
    "read %{y}<br>source %{x}<br>weight %{customdata[0]:.6~g}<br>logit %{customdata[1]:.6~g}"
    "<br>contribution %{customdata[2]:.6~g}<extra></extra>"
)
HEATMAPS = ("token_heatmap", "mean_heatmap", "source_heatmap")
_KINDS = ("weights", "logits", "contrib")


def model_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per model name, deterministic: "prenorm", "full", "block" have fixed colours;
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
    return out, list(labels)


def show_token(tok: str) -> str:
    """A token made visible for tick labels: newline -> ↵, tab -> ⇥, space -> ␣ (plain text, not HTML)."""
    shown = tok.replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")
    return shown if shown else "∅"


def _color_range(kind: str, z: np.ndarray) -> dict:
    if kind == "logits":
        finite = np.abs(z[np.isfinite(z)])
        m = float(finite.max()) if finite.size else 1.0
        return {"zmin": -max(m, 1e-6), "zmax": max(m, 1e-6)}
    return {"zmin": 0.0, "zmax": 1.0}


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


def _empty_note(trace: DepthTrace, kind: str, z: np.ndarray) -> list[dict]:
    if np.isfinite(z).any():
        return []
    if kind == "logits" and trace.residual == "prenorm":
        return [_note("PreNorm has no depth logits (unit coefficients): see kind='contrib'")]
    return [_note(f"no {kind} recorded")]


def _cell_heatmap(
    trace: DepthTrace, cells: dict[str, np.ndarray], labels: list[str], kind: str, title: str, expanded: bool
) -> go.Figure:
    """Reads x sources heatmap of ``cells[kind]`` ([R, S']), hover = weight, logit, contrib."""
    z = cells[kind]
    custom = np.stack([cells[k] for k in _KINDS], axis=-1)  # (R, S', 3)
    fig = go.Figure(
        go.Heatmap(
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
    )
    shapes = _read_block_lines(trace) + (_source_block_lines(trace) if expanded else [])
    notes = _empty_note(trace, kind, z)
    if kind == "weights" and trace.residual == "prenorm" and not notes:
        notes = [_note("PreNorm: every coefficient is 1 (see kind='contrib')", y=1.06)]
    fig.update_layout(
        title={"text": title},
        shapes=shapes,
        annotations=notes,
        plot_bgcolor="white",
        height=max(320, 24 * len(trace.read_labels) + 140),
        xaxis={"title": {"text": "source"}, "showgrid": False, "tickangle": -45 if len(labels) > 8 else 0},
        yaxis={"title": {"text": "read"}, "autorange": "reversed", "showgrid": False},
    )
    return fig


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
    title = f"{trace.name} · token {pos} {tok!r} (sequence {batch}) · {KIND_TITLES[kind]}"
    return _cell_heatmap(trace, cells, labels, kind, title, expanded)


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
    title = f"{trace.name} · mean over {trace.n_tokens} tokens · {KIND_TITLES[kind]}"
    return _cell_heatmap(trace, cells, labels, kind, title, expanded)


def source_heatmap(trace: DepthTrace, source: int | str = 0, batch: int = 0, kind: str = "weights") -> go.Figure:
    """One source's routing value at every token: tokens (x) x reads (y).

    Source 0 shows embedding retention token by token. Tokens sit at positions 0..n−1 on x,
    labelled with their strings (duplicates allowed).

    Returns:
        Figure with one Heatmap: ``z`` [R, n_tokens] (NaN where the source is unavailable),
        ``customdata`` [R, n_tokens, 3] = (weight, logit, contrib), ``text`` = token strings.
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
    text = np.tile(np.asarray([repr(t) for t in toks], dtype=object), (z.shape[0], 1))
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=np.arange(n),
            y=trace.read_labels,
            customdata=np.stack([cells[k] for k in _KINDS], axis=-1),
            text=text,
            hovertemplate="token %{x} %{text}<br>" + HOVER_CELLS.replace("source %{x}<br>", ""),
            hoverongaps=False,
            colorscale=COLORSCALES[kind],
            colorbar={"title": {"text": kind}},
            **_color_range(kind, z),
        )
    )
    label = trace.source_labels[s]
    fig.update_layout(
        title={"text": f"{trace.name} · source {label} at every token (sequence {batch}) · {KIND_TITLES[kind]}"},
        shapes=_read_block_lines(trace),
        annotations=_empty_note(trace, kind, z),
        plot_bgcolor="white",
        height=max(320, 24 * len(trace.read_labels) + 160),
        xaxis={
            "title": {"text": "token"},
            "tickmode": "array",
            "tickvals": list(range(n)),
            "ticktext": [show_token(t) for t in toks],
            "showgrid": False,
        },
        yaxis={"title": {"text": "read"}, "autorange": "reversed", "showgrid": False},
    )
    return fig


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
    titles = list(names) if names is not None else [f.layout.title.text or t.name for f, t in zip(figs, traces)]
    n = len(figs)
    out = make_subplots(rows=1, cols=n, subplot_titles=titles, horizontal_spacing=min(0.08, 0.4 / max(n - 1, 1)))
    kind = kw.get("kind", "weights")
    zmax = max(float(f.data[0].zmax) for f in figs) if kind == "logits" else 1.0
    shapes, notes = [], list(out.layout.annotations)
    for i, f in enumerate(figs):
        sfx = "" if i == 0 else str(i + 1)
        for tr in f.data:
            tr = go.Heatmap(tr)
            tr.showscale = i == n - 1
            if kind == "logits":
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
        out.update_xaxes(row=1, col=i + 1, tickmode=xa.tickmode, tickvals=xa.tickvals, ticktext=xa.ticktext, tickangle=xa.tickangle, showgrid=False)
    out.update_yaxes(autorange="reversed", showgrid=False)
    out.update_layout(
        shapes=shapes,
        annotations=notes,
        plot_bgcolor="white",
        height=max(f.layout.height or 400 for f in figs),
        title={"text": KIND_TITLES.get(kind, kind)},
    )
    return out


# -- depth profiles ---------------------------------------------------------------------------
def _line_names(traces: Sequence[DepthTrace]) -> list[str]:
    if not traces:
        raise ValueError("pass at least one DepthTrace")
    return unique_names([t.name for t in traces])


def magnitudes(traces: Sequence[DepthTrace]) -> go.Figure:
    """Hidden-state magnitude by depth, every trace in its own colour.

    Left: RMS of each read's mixed input h (``rms_in`` [B, P, R], mean over real tokens) by read.
    Right: RMS of each written source v (``rms_out`` [B, P, L+1]: embed, then every sublayer
    output), dashed. Both y axes are logarithmic.

    Returns:
        Figure with two Scatter traces per model (``rms_in`` then ``rms_out``), legend grouped by model.
    """
    names = _line_names(traces)
    colors = model_colors(names)
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("RMS of mixed input h, by read", "RMS of written source v (embed, sublayer outputs)")
    )
    for t, name in zip(traces, names):
        reads, srcs = metrics.read_profile(t), metrics.source_profile(t)
        line = {"color": colors[name]}
        fig.add_trace(
            go.Scatter(
                x=list(reads.index), y=reads["rms_in"].to_numpy(), name=name, legendgroup=name, mode="lines+markers",
                line=line, hovertemplate=f"{name}<br>read %{{x}}<br>rms(h) %{{y:.4~g}}<extra></extra>",
            ),
            row=1, col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=list(srcs.index), y=srcs["rms_out"].to_numpy(), name=name, legendgroup=name, showlegend=False,
                mode="lines+markers", line={**line, "dash": "dash"},
                hovertemplate=f"{name}<br>source %{{x}}<br>rms(v) %{{y:.4~g}}<extra></extra>",
            ),
            row=1, col=2,
        )
    fig.update_yaxes(type="log", title_text="RMS (log)")
    fig.update_layout(title={"text": "Magnitudes by depth"}, height=420)
    return fig


def gradient_norms(traces: Sequence[DepthTrace]) -> go.Figure:
    """Gradient norms by depth, every trace in its own colour.

    Left: per-token ‖∂Loss/∂h‖ at each read's mixed input (``grad_in`` [B, P, R], mean over real
    tokens). Right: each sublayer's parameter-gradient norm (``param_grad`` [L]). Log y axes.
    A trace recorded without backward draws no line and gets a note "<name>: no gradients
    recorded" on that panel instead.

    Returns:
        Figure with up to two Scatter traces per model (only those with finite values).
    """
    names = _line_names(traces)
    colors = model_colors(names)
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("‖∂Loss/∂h‖ per token at mixed inputs, by read", "parameter-gradient norm per sublayer")
    )
    notes = list(fig.layout.annotations)
    missing = {1: 0, 2: 0}
    shown = set()
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
            fig.add_trace(
                go.Scatter(
                    x=x, y=y, name=name, legendgroup=name, showlegend=name not in shown, mode="lines+markers",
                    line={"color": colors[name], "dash": "solid" if col == 1 else "dot"},
                    hovertemplate=f"{name}<br>{what} %{{x}}<br>{sym} %{{y:.4~g}}<extra></extra>",
                ),
                row=1, col=col,
            )
            shown.add(name)
    fig.update_yaxes(type="log", title_text="norm (log)")
    fig.update_layout(title={"text": "Gradient norms by depth"}, annotations=notes, height=420)
    return fig


# -- corpus aggregates (CorpusStats) ---------------------------------------------------------
def corpus_heatmap(stats, kind: str = "weights", name: str | None = None, value: str = "mean") -> go.Figure:
    """Mean depth routing over a corpus, reads (y) x sources (x), with each cell's spread.

    Each cell is the mean over every real token of the corpus (``stats.mean(kind)``); the hover
    adds the standard deviation over tokens and the count, so a mean of 0.3 made of 0.3s reads
    differently from one made of 0s and 1s. Unavailable cells stay blank.

    Args:
        stats: a :class:`~attnres_probe.stats.CorpusStats`.
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
            hovertemplate="read %{y}<br>source %{x}<br>mean %{customdata[0]:.4~g}<br>sd over tokens %{customdata[1]:.3~g}"
            "<br>tokens %{customdata[2]:.0f}<extra></extra>",
            hoverongaps=False, colorscale=COLORSCALES[kind] if value == "mean" else "Greys",
            colorbar={"title": {"text": kind if value == "mean" else "sd"}}, **colors,
        )
    )
    notes = _empty_note(trace, kind, z)
    if kind == "weights" and trace.residual == "prenorm" and not notes:
        notes = [_note("PreNorm: every coefficient is 1 (see kind='contrib')", y=1.06)]
    fig.update_layout(
        title={"text": f"{name} · {'mean' if value == 'mean' else 'sd'} over {stats.n_tokens} tokens in {stats.n_windows} windows"
                       f" · {KIND_TITLES[kind]}"},
        shapes=_read_block_lines(trace), annotations=notes, plot_bgcolor="white",
        height=max(320, 24 * len(trace.read_labels) + 140),
        xaxis={"title": {"text": "source"}, "showgrid": False, "tickangle": -45 if len(trace.source_labels) > 8 else 0},
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


BAND_NOTE = "lines: mean over windows; bands: 95% interval of that mean"


def _hex_rgba(color: str, alpha: float) -> str:
    c = color.lstrip("#")
    return f"rgba({int(c[0:2], 16)},{int(c[2:4], 16)},{int(c[4:6], 16)},{alpha})"


def _band_figure(stats: Sequence, names: Sequence[str] | None, panels: list[tuple[str, str, str]], title: str) -> go.Figure:
    """Line + band per model on each panel; panels = [(profile name, subplot title, y label)]."""
    stats = list(stats)
    if not stats:
        raise ValueError("pass at least one CorpusStats")
    names = unique_names(list(names) if names is not None else [s.name for s in stats])
    colors = model_colors(names)
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[1] for p in panels])
    notes = list(fig.layout.annotations)
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
            fig.add_trace(go.Scatter(x=x + x[::-1], y=np.concatenate([hi, lo[::-1]]), fill="toself", mode="lines",
                                     line={"width": 0}, fillcolor=_hex_rgba(colors[name], 0.2), hoverinfo="skip",
                                     legendgroup=name, showlegend=False, name=f"{name} band"), row=1, col=col)
            fig.add_trace(go.Scatter(
                x=x, y=prof["mean"].to_numpy(float), name=name, legendgroup=name, showlegend=col == 1, mode="lines+markers",
                line={"color": colors[name]}, customdata=np.stack([lo, hi, prof["windows"].to_numpy(float)], axis=-1),
                hovertemplate=f"{name}<br>%{{x}}<br>{ylabel} %{{y:.4~g}}<br>95% interval [%{{customdata[0]:.4~g}}, "
                "%{customdata[1]:.4~g}]<br>windows %{customdata[2]:.0f}<extra></extra>",
            ), row=1, col=col)
    for col, (_, _, ylabel) in enumerate(panels, start=1):
        fig.update_yaxes(type="log", title_text=f"{ylabel} (log)", row=1, col=col)
    fig.update_layout(title={"text": f"{title} ({BAND_NOTE})"}, annotations=notes, height=440)
    return fig


def magnitude_bands(stats: Sequence, names: Sequence[str] | None = None) -> go.Figure:
    """Magnitudes by depth over a corpus: RMS of mixed inputs by read and of written sources, each a
    line (mean over windows of the window's mean) with a band (95% interval of that mean)."""
    return _band_figure(stats, names, [("rms_in", "RMS of mixed input h, by read", "rms(h)"),
                                       ("rms_out", "RMS of written source v", "rms(v)")], "Magnitudes by depth")


def gradient_bands(stats: Sequence, names: Sequence[str] | None = None) -> go.Figure:
    """Gradient norms by depth over a corpus: ‖∂Loss/∂h‖ by read and parameter-gradient norm by
    sublayer, each a line (mean over windows) with a band (95% interval of that mean)."""
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
        Figure: bars of Δloss per source (left axis) and markers of mass and contrib (right axis, shares).
    """
    missing = [c for c in ABLATION_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"ablation frame lacks columns {missing}; it needs {list(ABLATION_COLUMNS)}")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    if frame.empty:
        fig.update_layout(title={"text": "Ablation"}, annotations=[_note("no ablation results", "paper", "paper")])
        return fig
    reads = list(dict.fromkeys(frame["read"]))
    read = reads[0] if read is None else read
    if read not in reads:
        raise KeyError(f"read {read!r} is not in the ablation frame; it has {reads}")
    rows = frame[frame["read"] == read]
    modes = list(dict.fromkeys(rows["mode"])) if "mode" in rows.columns else [None]
    for i, mode in enumerate(modes):
        sub = rows if mode is None else rows[rows["mode"] == mode]
        label = "Δloss when ablated" if mode is None else f"Δloss when ablated ({mode})"
        fig.add_trace(
            go.Bar(x=[str(s) for s in sub["source"]], y=sub["delta_loss"].to_numpy(), name=label,
                   marker_color=ABLATION_BAR_COLORS[i % len(ABLATION_BAR_COLORS)],
                   hovertemplate=f"source %{{x}}<br>{label} %{{y:.4~g}}<extra></extra>"),
            secondary_y=False,
        )
    rows = rows.drop_duplicates("source")  # mass and contrib do not depend on the mode
    x = [str(s) for s in rows["source"]]
    for col, label, color, symbol in (("mass", "routing mass α", "#1F77B4", "circle"), ("contrib", "contribution share c", "#2CA02C", "diamond")):
        fig.add_trace(
            go.Scatter(x=x, y=rows[col].to_numpy(), name=label, mode="markers", marker={"color": color, "size": 11, "symbol": symbol},
                       hovertemplate=f"source %{{x}}<br>{label} %{{y:.4~g}}<extra></extra>"),
            secondary_y=True,
        )
    fig.update_yaxes(title_text="Δloss", secondary_y=False, zeroline=True)
    fig.update_yaxes(title_text="share", secondary_y=True, rangemode="tozero", showgrid=False)
    fig.update_layout(
        title={"text": f"Ablation at read {read}: Δloss per source vs routing mass"}, xaxis_title="source", barmode="group", height=420
    )
    return fig


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
    recorded, the flags (in a warning colour, only when there are any) and the first ``n_tokens``
    tokens of the first sequence. Every string taken from the trace is escaped with :func:`html.escape`.
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


def over_training(histories: dict[str, Sequence[dict]], read_labels: Sequence[str] | None = None) -> go.Figure:
    """How routing changes during training: per read, against the training step, one column per run.

    Args:
        histories: run name -> its probe summaries (``train_log.json``'s ``probes.history``,
            recorded with ``train --probe-every N``; see :mod:`attnres_probe.training.probes`).
        read_labels: the reads' labels (default ``L0.attn`` … ``final`` from the history's length).

    Returns:
        Figure: rows = embedding weight, recent-source mass, entropy, mixed-input RMS (one line
        per read, early reads light, late reads dark), and the gradient spread (the CV of the
        per-read gradient norms, one line); columns = runs. PreNorm has no routing weights: its
        weight rows say so instead of drawing a constant.
    """
    names = list(histories)
    if not names:
        raise ValueError("over_training() needs at least one run's probe history")
    for name in names:
        if not histories[name]:
            raise ValueError(f"run {name!r} has no routing probes (train it with --probe-every N)")
    rows = [*OVER_TRAINING_ROWS, ("act_grad_cv", "gradient spread (CV over reads)")]
    fig = make_subplots(
        rows=len(rows), cols=len(names), shared_xaxes=True, column_titles=names,
        row_titles=None, vertical_spacing=0.05, horizontal_spacing=0.06,
    )
    import plotly.colors as pc

    for c, name in enumerate(names, start=1):
        hist = sorted(histories[name], key=lambda h: h["step"])
        steps = [h["step"] for h in hist]
        n_reads = len(hist[0]["rms_in"])
        labels = list(read_labels) if read_labels is not None and len(read_labels) == n_reads else [
            *(f"L{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}" for i in range(n_reads - 1)), "final"]
        shades = pc.sample_colorscale("Viridis", [0.9 - 0.8 * r / max(1, n_reads - 1) for r in range(n_reads)])
        for rw, (key, title) in enumerate(rows, start=1):
            if key == "act_grad_cv":
                fig.add_trace(go.Scatter(x=steps, y=[h.get(key) for h in hist], mode="lines+markers", name=f"{name} · grad CV",
                                         line={"color": "#444"}, showlegend=False,
                                         hovertemplate="step %{x}<br>CV %{y:.3f}<extra>" + html.escape(name) + "</extra>"), row=rw, col=c)
            else:
                values = np.array([[np.nan if v is None else v for v in h[key]] for h in hist], dtype=float)  # (steps, R)
                if not np.isfinite(values).any():
                    fig.add_annotation(text="no routing weights (PreNorm)" if key != "rms_in" else "not recorded",
                                       xref="x domain" if rw == 1 and c == 1 else f"x{(rw - 1) * len(names) + c} domain",
                                       yref="y domain" if rw == 1 and c == 1 else f"y{(rw - 1) * len(names) + c} domain",
                                       x=0.5, y=0.5, showarrow=False, font={"color": "#777"})
                for r in range(n_reads):
                    fig.add_trace(go.Scatter(
                        x=steps, y=values[:, r], mode="lines", line={"color": shades[r], "width": 1.5},
                        name=labels[r], legendgroup=labels[r], showlegend=(rw == 1 and c == 1),
                        hovertemplate=f"{html.escape(labels[r])}<br>step %{{x}}<br>%{{y:.3f}}<extra>{html.escape(name)}</extra>",
                    ), row=rw, col=c)
            if c == 1:
                fig.update_yaxes(title={"text": title, "font": {"size": 11}}, row=rw, col=c)
        fig.update_xaxes(title={"text": "training step"}, row=len(rows), col=c)
    fig.update_layout(height=190 * len(rows) + 120, title={"text": "Routing over training (held-out probe windows)"},
                      plot_bgcolor="white", legend={"title": {"text": "read"}})
    return fig
