"""The dashboard's attention-pattern view: per model, the selected token's attention pattern for a
chosen layer and head (``blocks.{layer}.attn.hook_pattern``), beside the depth routing.

:func:`pattern_section` is the layout (placed by :func:`attnres_probe.dashboards.layout.build_layout`
after the per-token depth routing), :func:`pattern_views` the callback as a plain function of the
explorer and the browser's values (tests call it directly), :func:`register` binds it to one app
(called from :func:`attnres_probe.dashboards.callbacks.register`).

Cost: nothing is recorded with the traces, and the depth-routing callbacks compute nothing more. A
live model's pattern of one layer (every head, every query) is computed on demand, by one forward
pass without gradients that hooks that layer only and ends after it
(:meth:`attnres_probe.Probe.attention_patterns`), and kept in a small cache bounded in bytes
(:class:`PatternCache`): the first request of a layer runs the text up to the selected token only
(attention is causal), a later token past it runs the whole text once, and from then on another
token or head of that layer costs a slice. A saved trace shows the patterns it holds (recorded with
``patterns=True``), else a note.

The page opens on the most concentrated head at the opening token (:func:`opening_head`: the lowest
entropy of the pattern row, averaged over the AttnRes models), not on layer 0 head 0, which is
often flat; a note says so. That costs one forward pass per live model when the page is built,
over the text up to the opening token, keeping that token's row of every layer and head only.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from dash import Input, Output, dcc, html, no_update

from attnres_probe import figures
from attnres_probe.dashboards.state import Explorer, UnknownKeyError, whole_number

__all__ = ["PATTERN_HEAD", "PATTERN_LAYER", "PatternCache", "opening_head", "pattern_section", "pattern_views", "register"]

PATTERN_LAYER = "pattern-layer"
PATTERN_HEAD = "pattern-head"
PATTERN_OPENED = "pattern-opened"  # the note saying which layer and head the page opened on, and why
SECTION_ID = "attention-patterns"
TOKEN_STORE = "token"  # the selected-token store of the page (attnres_probe.dashboards.layout.TOKEN)
GRAPH_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "svg"}}
SHOWN, HIDDEN = {"display": "block"}, {"display": "none"}
CACHE_BYTES = 256 * 2**20  # patterns kept for the dashboard, all results and models together
HELP = ("For the selected token, how one attention head of one layer spreads its weight over the tokens before it "
        "(blocks.{layer}.attn.hook_pattern: the softmax over the key positions the causal mask lets the token see; "
        "the bars sum to one). Depth routing above says which earlier sublayers a read mixes; this says which earlier "
        "tokens an attention sublayer reads. A live model computes a layer's pattern on demand (one forward pass up to "
        "that layer, then kept); a saved trace shows patterns only if it was recorded with patterns=True.")


def panel_id(part: str, index: int) -> str:
    """Id of a per-model element of this section: ``panel_id("graph", 0) == "pattern-graph-0"``."""
    return f"pattern-{part}-{index}"


def _shape(ex: Explorer, name: str) -> tuple[int, int] | None:
    """(n_layers, n_heads) of an entry, or None when it has no attention patterns to show."""
    if name in ex.probes:
        probe = ex.probes[name]
        if not probe.spec.pattern_hooks:
            return None
        cfg = getattr(probe.model, "cfg", None)
        return len(probe.spec.pattern_hooks), int(getattr(cfg, "n_heads", 0) or 0)
    trace = ex.saved.get(name)
    if trace is None or trace.patterns is None:
        return None
    return _saved_shape(trace)


def _saved_shape(trace: Any) -> tuple[int, int]:
    """(the model's layers, its heads) of a saved trace with patterns (it may hold some of them only)."""
    return (len(trace.read_labels) - 1) // 2, int(trace.meta.get("pattern_n_heads") or trace.patterns.shape[2])


def _options(ex: Explorer) -> tuple[int, int]:
    """The most layers and heads among the entries (the dropdowns offer every one)."""
    shapes = [s for s in (_shape(ex, n) for n in ex.names) if s is not None]
    return max((s[0] for s in shapes), default=1), max((s[1] for s in shapes), default=1)


def _opening_rows(ex: Explorer, name: str, trace: Any, pos: int) -> np.ndarray:
    """[layer, head, key] of one entry at token ``pos`` of the initial text: a live model runs the text up
    to that token and keeps its row (not cached: only the row is needed); a saved trace slices its own."""
    if name in ex.probes:
        import torch

        tokens = np.ascontiguousarray(trace.tokens[:1, : pos + 1])
        with ex._model_lock:
            out = ex.probes[name].attention_patterns(torch.from_numpy(tokens).long(), positions=[pos])
        return np.asarray(out[0, :, :, 0, : pos + 1], dtype=np.float64)
    n_layers, n_heads = _saved_shape(trace)
    rows = np.full((n_layers, n_heads, pos + 1), np.nan)  # layers and heads the trace did not record: NaN
    for i, layer in enumerate(trace.pattern_layers):
        rows[layer, trace.pattern_heads] = trace.patterns[0, i, :, pos, : pos + 1]
    return rows


def opening_head(ex: Explorer) -> tuple[int, int, str]:
    """The layer and head the page opens on, and why: at the token the page opens on
    (:func:`~attnres_probe.analysis.windows.informative_token`, as the token strip), the head whose
    pattern row is the most concentrated, the lowest entropy of its weights averaged over the AttnRes
    models (all the models with patterns when none is AttnRes), among the layers and heads they all
    have. (0, 0, "") when there is nothing to choose between (no patterns, or token 0, where every head
    puts all its weight on the token itself); never raises.

    Returns:
        (layer, head, a one-line note)
    """
    from attnres_probe.analysis.windows import informative_token

    try:
        result = ex.initial
        pos, _ = informative_token(result.traces.values())
        have = [n for n in ex.names if n in result.traces and _shape(ex, n) is not None
                and 0 <= pos < int(result.traces[n].mask[0].sum())]
        routed = [n for n in have if ex.residual_of(n) != "prenorm"]
        chosen = routed or have
        if not chosen or pos < 1:
            return 0, 0, ""
        rows = [_opening_rows(ex, n, result.traces[n], pos) for n in chosen]
        n_layers, n_heads = min(r.shape[0] for r in rows), min(r.shape[1] for r in rows)
        entropy = np.zeros((n_layers, n_heads))
        for r in rows:
            w = np.clip(r[:n_layers, :n_heads], 0.0, None)
            w = w / np.maximum(w.sum(-1, keepdims=True), 1e-30)
            h = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0), axis=-1) / len(rows)
            entropy += np.where(np.isnan(r[:n_layers, :n_heads]).any(-1), np.nan, h)
        finite = np.isfinite(entropy)  # NaN: a layer or head a saved trace did not record
        if not finite.any() or np.ptp(entropy[finite]) < 1e-9:
            return 0, 0, ""
        layer, head = (int(i) for i in np.unravel_index(int(np.argmin(np.where(finite, entropy, np.inf))), entropy.shape))
    except Exception:  # choosing the opening head must never break the page: layer 0 head 0 then
        return 0, 0, ""
    tok = figures.show_token(str(result.str_tokens[pos])) if pos < len(result.str_tokens) else ""
    return layer, head, (
        f"Opened on layer {layer} head {head}, the most concentrated pattern at the token the page opened on ({pos} '{tok}'): the "
        f"lowest entropy of its weights, {entropy[layer, head]:.2f} nats averaged over {', '.join(chosen)} "
        f"({math.log(pos + 1):.2f} would be an even spread over the {pos + 1} tokens it sees).")


def pattern_section(ex: Explorer) -> html.Section:
    """The section: layer and head dropdowns (opened on :func:`opening_head`, with its note), then one
    panel per model (a note and the pattern chart)."""
    n_layers, n_heads = _options(ex)
    layer0, head0, opened = opening_head(ex)
    panels = []
    for i, name in enumerate(ex.names):
        color = ex.colors[name]
        body = [
            html.Div([html.Span(className="swatch", style={"backgroundColor": color}), html.B(name),
                      html.Span(" · " + ex.describe(name), className="muted")], className="panel-title"),
            html.Div(id=panel_id("note", i), className="help"),
            dcc.Graph(id=panel_id("graph", i), config=GRAPH_CONFIG, className="graph"),
        ]
        panels.append(html.Div(html.Div(body, className="panel", style={"borderTopColor": color}),
                               id=panel_id("panel", i), className="panel-slot"))
    return html.Section(
        [
            html.H2("Attention pattern of the selected token"),
            html.P(HELP, className="help"),
            html.Div(
                [
                    html.Label("layer", className="control-label", htmlFor=PATTERN_LAYER),
                    dcc.Dropdown(id=PATTERN_LAYER, options=[{"label": f"layer {i}", "value": i} for i in range(n_layers)],
                                 value=layer0, clearable=False, className="dropdown"),
                    html.Label("head", className="control-label", htmlFor=PATTERN_HEAD),
                    dcc.Dropdown(id=PATTERN_HEAD, options=[{"label": f"head {h}", "value": h} for h in range(n_heads)],
                                 value=head0, clearable=False, className="dropdown"),
                ],
                className="row controls",
            ),
            html.P(opened, id=PATTERN_OPENED, className="help"),
            html.Div(panels, className="panels"),
        ],
        className="card",
        id=SECTION_ID,
    )


class PatternCache:
    """One layer's patterns [head, query, key] per (result key, model, layer), least recently used
    dropped first once the arrays exceed ``max_bytes`` (the newest is always kept)."""

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> np.ndarray | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        return None

    def put(self, key: tuple, value: np.ndarray) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            total = sum(v.nbytes for v in self._items.values())
            while total > self.max_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                total -= old.nbytes

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(v.nbytes for v in self._items.values())


def cache_of(ex: Explorer) -> PatternCache:
    """The explorer's pattern cache (made on first use)."""
    with ex._cache_lock:
        cache = ex.__dict__.get("pattern_cache")
        if cache is None:
            cache = ex.__dict__["pattern_cache"] = PatternCache()
    return cache


def layer_patterns(ex: Explorer, result: Any, name: str, layer: int, token: int) -> np.ndarray:
    """The patterns [head, m, m] of one layer of a live model on the first m tokens of the result's
    sequence 0, m > ``token`` (cached).

    Attention is causal, so the patterns of the first m tokens are the top-left m x m block of the
    whole text's. The first request for a layer computes the prefix up to ``token`` only (the page
    opens without paying for the whole text); a later token past the cached prefix computes the
    whole text once.
    """
    key = (result.key, name, layer)
    cache = cache_of(ex)
    got = cache.get(key)
    if got is not None and token < got.shape[-1]:
        return got
    trace = result.traces[name]
    n = int(trace.mask[0].sum())
    m = n if got is not None else token + 1
    tokens = np.ascontiguousarray(trace.tokens[:1, :m])  # the ids it was recorded on: no new tokenizing
    import torch

    with ex._model_lock:
        out = ex.probes[name].attention_patterns(torch.from_numpy(tokens).long(), layers=[layer])
    value = np.ascontiguousarray(out[0, 0])  # [head, query, key]
    cache.put(key, value)
    return value


def pattern_views(ex: Explorer, token: Any, layer: Any, head: Any) -> dict:
    """Every model's attention pattern at the selected token, for one layer and head.

    Args:
        token: the token store, {"key": result key, "token": position in sequence 0}.
        layer, head: the dropdowns' values (ints).

    Returns:
        {"figures": [Figure or no_update per model], "graphs": [style], "panels": [style], "notes": [str]}
    """
    n = len(ex.names)
    keep = {"figures": [no_update] * n, "graphs": [no_update] * n, "panels": [no_update] * n, "notes": [no_update] * n}
    if not isinstance(token, dict):
        return keep
    try:
        result = ex.result(token.get("key"))
    except UnknownKeyError as exc:
        return {**keep, "notes": [str(exc)] * n}
    pos, layer, head = whole_number(token.get("token")), whole_number(layer), whole_number(head)
    out: dict[str, list] = {k: [] for k in keep}

    def add(fig, graph, panel, note):
        for k, v in zip(out, (fig, graph, panel, note)):
            out[k].append(v)

    for name in ex.names:
        trace = result.traces.get(name)
        if trace is None:
            add(no_update, HIDDEN, HIDDEN, "")
            continue
        shape = _shape(ex, name) if name in ex.probes else (_saved_shape(trace) if trace.patterns is not None else None)
        if shape is None:
            why = ("this saved trace holds no attention patterns (record it with Probe(model).run(text, patterns=True))"
                   if name not in ex.probes else "this model has no attention-pattern hook points")
            add(no_update, HIDDEN, SHOWN, f"{name}: {why}")
            continue
        n_layers, n_heads = shape
        n_tok = int(trace.mask[0].sum())
        if pos is None or not 0 <= pos < n_tok:
            add(no_update, HIDDEN, SHOWN, f"{name} has no token {token.get('token')!r} (0..{n_tok - 1})")
            continue
        if layer is None or not 0 <= layer < n_layers or head is None or not 0 <= head < n_heads:
            add(no_update, HIDDEN, SHOWN, f"{name} has layers 0..{n_layers - 1} and heads 0..{n_heads - 1}: choose one of them")
            continue
        try:
            if name in ex.probes:
                row = layer_patterns(ex, result, name, layer, pos)[head, pos]
            else:
                row = trace.pattern(layer, head, token=pos)
        except ValueError as exc:  # a saved trace that recorded other layers or heads: it says which
            add(no_update, HIDDEN, SHOWN, f"{name}: {exc}")
            continue
        except Exception as exc:  # a model that cannot be read this way must not break the page
            add(no_update, HIDDEN, SHOWN, f"{name}: cannot compute the attention pattern ({exc})")
            continue
        fig = figures.attention_pattern_chart(row, trace.str_tokens[0], pos, layer, head, name=name, color=ex.colors[name])
        add(fig, SHOWN, SHOWN, "")
    return out


def register(app, ex: Explorer) -> None:
    """Bind :func:`pattern_views` to ``app``: the selected token and the two dropdowns in, every panel out."""
    n = len(ex.names)

    def _views(token, layer, head):
        return pattern_views(ex, token, layer, head)

    app.callback(
        output={"figures": [Output(panel_id("graph", i), "figure") for i in range(n)],
                "graphs": [Output(panel_id("graph", i), "style") for i in range(n)],
                "panels": [Output(panel_id("panel", i), "style") for i in range(n)],
                "notes": [Output(panel_id("note", i), "children") for i in range(n)]},
        inputs=[Input(TOKEN_STORE, "data"), Input(PATTERN_LAYER, "value"), Input(PATTERN_HEAD, "value")],
    )(_views)
