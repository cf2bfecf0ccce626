"""The dashboard's page: header, prompt box, token strip, one panel per model for each view.

Every chart is a ``dcc.Graph`` filled by a callback with a figure from
:mod:`attnres_probe.figures`; this module only places components and writes short help texts.
Element ids are the constants below (per-model panels take the model's index: ``token-graph-0``).
User text (prompts, token strings, model names) only ever goes into components as text.
"""

from __future__ import annotations

from dash import dcc, html

from attnres_probe.dashboards.state import ABLATION_MODES, Explorer

__all__ = ["build_layout", "panel_id", "KIND_OPTIONS"]

# ids of the single components
KEY = "trace-key"
TOKEN = "token"
PROMPT = "prompt"
RUN = "run"
PROMPT_STATUS = "prompt-status"
STRIP = "token-strip"
STRIP_NOTE = "token-strip-note"
TOKEN_INFO = "token-info"
KIND = "kind"
EXPANDED = "expanded"
SOURCE = "source"
MAGNITUDES = "magnitudes"
GRADIENTS = "gradients"
CARDS = "metric-cards"
ABL_MODEL = "ablation-model"
ABL_READ = "ablation-read"
ABL_MODE = "ablation-mode"
ABL_RUN = "ablation-run"
ABL_GRAPH = "ablation-graph"
ABL_STATUS = "ablation-status"
CHIP = "chip"  # pattern-matching type of the token chips: {"type": "chip", "index": i}

KIND_OPTIONS = [
    {"label": "depth weights α", "value": "weights"},
    {"label": "contribution share c", "value": "contrib"},
    {"label": "depth logits z", "value": "logits"},
]
GRAPH_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "svg"}}


def panel_id(view: str, part: str, index: int) -> str:
    """Id of a per-model element: ``panel_id("token", "graph", 0) == "token-graph-0"``."""
    return f"{view}-{part}-{index}"


def _help(text: str) -> html.P:
    return html.P(text, className="help")


def _swatch(color: str) -> html.Span:
    return html.Span(className="swatch", style={"backgroundColor": color})


def _header(ex: Explorer) -> html.Header:
    badges = []
    for name in ex.names:
        role = "baseline" if name == ex.baseline else ("saved trace" if name in ex.saved else "")
        badges.append(
            html.Span(
                [_swatch(ex.colors[name]), html.B(name), html.Span(" · " + ex.describe(name), className="muted"),
                 html.Span(role, className="role") if role else None],
                className="badge",
                style={"borderColor": ex.colors[name]},
            )
        )
    if ex.baseline is None:
        base = "No PreNorm baseline is loaded: metric cards show absolute values only."
    else:
        base = f"Baseline: {ex.baseline}. Every AttnRes model is set against it."
    return html.Header(
        [
            html.H1(["attnres-probe ", html.Span("depth-routing explorer", className="muted")]),
            html.Div(badges, className="badges", id="model-badges"),
            html.P(base, className="help"),
        ],
        className="header",
    )


def _guide() -> html.Details:
    return html.Details(
        [
            html.Summary("How to read this page"),
            html.Ul(
                [
                    html.Li("Every AttnRes sublayer reads a softmax mixture of earlier depth sources (the embedding, "
                            "earlier sublayer outputs or blocks); PreNorm adds them all with weight one."),
                    html.Li("Rows of a heatmap are reads (one per sublayer, then the final read), columns are sources. "
                            "Blank cells are sources a read cannot see yet; black lines mark block boundaries."),
                    html.Li("Contribution share c = ⟨coef·v, h⟩ / ‖h‖² is defined for every model, so it is the way to "
                            "compare with the PreNorm baseline. Hover a cell for the exact weight, logit and share."),
                    html.Li("Click a token (or a cell of the 'one source' heatmap) to see how that token routes."),
                ]
            ),
        ],
        className="guide",
    )


def _prompt(ex: Explorer) -> html.Section:
    if ex.live:
        limit = f"Up to {ex.n_ctx} tokens (the models' context); the byte tokenizer counts one token per byte."
        note = None
    else:
        limit = ""
        note = html.P(
            "Traces-only mode: this dashboard shows saved traces and has no model to run new text. "
            "Start it with --models DIR … to explore new prompts.",
            className="notice",
            id="traces-only-note",
        )
    text = ex.initial.text if ex.initial.text is not None else "".join(ex.initial.str_tokens)
    return html.Section(
        [
            html.H2("Prompt"),
            note,
            dcc.Textarea(
                id=PROMPT,
                value=text,
                maxLength=ex.max_chars or None,
                disabled=not ex.live,
                className="prompt",
                placeholder="Type a text to run through every model",
                spellCheck=False,
            ),
            html.Div(
                [
                    html.Button("Run", id=RUN, n_clicks=0, disabled=not ex.live, className="primary"),
                    html.Span(limit, className="help inline"),
                ],
                className="row",
            ),
            html.Div(id=PROMPT_STATUS, className="status", role="status"),
        ],
        className="card",
    )


def _token_section(ex: Explorer) -> html.Section:
    return html.Section(
        [
            html.H2("Tokens"),
            _help("Click a token to route it: every per-token view below follows the selection."),
            html.Div(id=STRIP, className="strip"),
            html.Div(id=STRIP_NOTE, className="help"),
            html.Div(id=TOKEN_INFO, className="token-info"),
        ],
        className="card",
    )


def _panels(ex: Explorer, view: str, note: bool = False, loading: bool = False) -> html.Div:
    panels = []
    for i, name in enumerate(ex.names):
        graph = dcc.Graph(id=panel_id(view, "graph", i), config=GRAPH_CONFIG, className="graph")
        body = [
            html.Div([_swatch(ex.colors[name]), html.B(name), html.Span(" · " + ex.describe(name), className="muted")],
                     className="panel-title"),
            html.Div(id=panel_id(view, "note", i), className="help") if note else None,
            graph,
        ]
        # the outer slot's style is what callbacks toggle (display); the colour sits on the inner panel
        panels.append(
            html.Div(html.Div(body, className="panel", style={"borderTopColor": ex.colors[name]}),
                     id=panel_id(view, "panel", i), className="panel-slot")
        )
    return html.Div(panels, className="panels")


def _controls() -> html.Div:
    return html.Div(
        [
            html.Label("colour by", className="control-label"),
            dcc.RadioItems(id=KIND, options=KIND_OPTIONS, value="weights", inline=True, className="radio"),
            dcc.Checklist(
                id=EXPANDED,
                options=[{"label": "expanded sublayer view (Block: one column per sublayer)", "value": "expanded"}],
                value=[],
                inline=True,
                className="radio",
            ),
        ],
        className="row controls",
    )


def _token_views(ex: Explorer) -> html.Section:
    return html.Section(
        [
            html.H2("Depth routing of the selected token"),
            _help("Reads (rows) × sources (columns) for the selected token, AttnRes beside the baseline. "
                  "PreNorm's weights are all one: switch to contribution share to compare."),
            _controls(),
            _panels(ex, "token", note=True),
        ],
        className="card",
    )


def _mean_views(ex: Explorer) -> html.Section:
    return html.Section(
        [
            html.H2("Mean routing over all tokens"),
            _help("The same heatmap averaged over every token of the prompt (uses the colour and view choices above)."),
            _panels(ex, "mean"),
        ],
        className="card",
    )


def _source_views(ex: Explorer) -> html.Section:
    options = ex.source_options()
    return html.Section(
        [
            html.H2("One source at every token"),
            _help("Tokens (x) × reads (y) for one source; 'embed' shows embedding retention token by token. "
                  "Click a cell to select its token."),
            html.Div(
                [html.Label("source", className="control-label"),
                 dcc.Dropdown(id=SOURCE, options=[{"label": s, "value": s} for s in options], value=options[0],
                              clearable=False, className="dropdown")],
                className="row controls",
            ),
            _panels(ex, "source", note=True),
        ],
        className="card",
    )


def _profiles() -> html.Section:
    return html.Section(
        [
            html.H2("Magnitudes and gradients by depth"),
            _help("Every loaded model in one chart, in its own colour. PreNorm's residual stream grows with depth; "
                  "AttnRes keeps magnitudes bounded and spreads gradients more evenly."),
            html.Div(
                [dcc.Graph(id=MAGNITUDES, config=GRAPH_CONFIG, className="graph"),
                 dcc.Graph(id=GRADIENTS, config=GRAPH_CONFIG, className="graph")],
                className="stack",
            ),
        ],
        className="card",
    )


def _cards() -> html.Section:
    return html.Section(
        [
            html.H2("Metrics against the baseline"),
            _help("Hover a metric name for its formula. 'vs baseline' is a ratio (×) for spreads and growths, "
                  "a difference (±) otherwise."),
            html.Div(id=CARDS, className="cards"),
        ],
        className="card",
    )


def _ablation(ex: Explorer) -> html.Section:
    models = ex.attnres_probes
    if not models:
        why = ("Routing ablation needs a live Full or Block AttnRes model; this dashboard has "
               + ("saved traces only." if not ex.live else "only PreNorm models (no softmax weights to edit)."))
        return html.Section([html.H2("Routing ablation"), html.P(why, className="notice", id=ABL_STATUS)], className="card")
    reads = ex.read_options(models[0])
    return html.Section(
        [
            html.H2("Routing ablation"),
            _help("Remove one source from one read (weights renormalised) and measure the change in next-token loss, "
                  "beside how much routing mass and contribution that source had. Large mass with small Δloss "
                  "means the mass is not needed."),
            html.Div(
                [
                    html.Label("model", className="control-label"),
                    dcc.Dropdown(id=ABL_MODEL, options=[{"label": m, "value": m} for m in models], value=models[0],
                                 clearable=False, className="dropdown"),
                    html.Label("read", className="control-label"),
                    dcc.Dropdown(id=ABL_READ, options=[{"label": r, "value": r} for r in reads], value=reads[-1],
                                 clearable=False, className="dropdown"),
                    html.Label("mode", className="control-label"),
                    dcc.RadioItems(id=ABL_MODE, options=list(ABLATION_MODES), value="zero", inline=True, className="radio"),
                    html.Button("Run ablation", id=ABL_RUN, n_clicks=0),
                ],
                className="row controls",
            ),
            html.Div(id=ABL_STATUS, className="status", role="status"),
            dcc.Loading(dcc.Graph(id=ABL_GRAPH, config=GRAPH_CONFIG, className="graph"), type="dot", delay_show=300),
        ],
        className="card",
    )


def build_layout(ex: Explorer) -> html.Div:
    """The whole page for an :class:`Explorer` (stores hold the result key and the selected token only)."""
    return html.Div(
        [
            dcc.Store(id=KEY, data=ex.initial.key),
            dcc.Store(id=TOKEN, data=None),
            _header(ex),
            _guide(),
            _prompt(ex),
            _token_section(ex),
            _token_views(ex),
            _mean_views(ex),
            _source_views(ex),
            _profiles(),
            _cards(),
            _ablation(ex),
            html.Footer("attnres-probe · charts from attnres_probe.figures · traces stay on the server", className="help"),
        ],
        className="page",
    )
